//! What the deviceless tests of the kernels and of the layer runner share: layer
//! configurations that select our kernels and cuDNN's graphs, a fake buffer table, and a
//! reading of [`SOURCE`].

use super::SOURCE;
use crate::cbr::device_buffers::{DeviceBuffer, Side};
use crate::cbr::graphs::{ApplyResidual, BackwardResidual};
use crate::cbr::layer::{route_buffers, CbrConfig, LayerGraph};
use crate::cbr::shape::ConvShape;
use crate::error::{Error, Result};

/// Layers of every kind the networks plan: 3-channel stems (statistics on our kernel),
/// 20-channel layers (no 8-wide vector access), first convs with 8k channels (conv +
/// GenStats), inner convs through the previous BN with each apply form and backward
/// residual, and a projection shortcut's BN.
pub(crate) fn configs() -> Vec<CbrConfig> {
    let sq = ConvShape::square;
    vec![
        CbrConfig::first(sq(8, 3, 32, 64, 7, 3, 2)).with_apply(ApplyResidual::None),
        CbrConfig::first(sq(2, 3, 16, 20, 3, 1, 1)),
        CbrConfig::first(sq(2, 16, 16, 32, 3, 1, 1)).with_apply(ApplyResidual::None),
        CbrConfig::new(sq(2, 20, 8, 20, 3, 1, 1)),
        CbrConfig::new(sq(2, 20, 8, 20, 3, 1, 1)).with_apply(ApplyResidual::Add),
        CbrConfig::new(sq(4, 64, 14, 64, 3, 1, 1)),
        CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1))
            .with_apply(ApplyResidual::Add)
            .with_backward_residual(BackwardResidual::FuseAdd),
        CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1)).with_apply(ApplyResidual::DualScaleBias),
        CbrConfig::new(sq(4, 64, 14, 256, 1, 0, 1)).with_shortcut_bn(),
        CbrConfig::after_activation(sq(4, 32, 8, 64, 3, 1, 2)).with_apply(ApplyResidual::None),
    ]
}

/// A buffer table over `graphs`' buffers (this layer's and the previous one's) at
/// distinct 256-byte-aligned fake addresses, each its exact size: what a launch is built
/// over without a device.
pub(crate) fn fake_buffers(
    graphs: &[LayerGraph],
) -> impl Fn(Side, &'static str) -> Result<DeviceBuffer> {
    let (this, prev) = route_buffers(graphs);
    move |side, name| {
        let (table, base) = match side {
            Side::This => (&this, 0x7f00_0000_0000u64),
            Side::Prev => (&prev, 0x7e00_0000_0000u64),
        };
        let i = table
            .iter()
            .position(|b| b.name == name)
            .ok_or_else(|| Error::Buffer {
                name: name.into(),
                problem: "is not a buffer of the route".into(),
            })?;
        Ok(DeviceBuffer {
            ptr: base + ((i as u64) << 32),
            bytes: table[i].bytes(),
            dtype: table[i].dtype,
        })
    }
}

/// The source's kernels as (entry, parameter names in order, body).
pub(crate) fn entries() -> Vec<(String, Vec<String>, String)> {
    let mut out = Vec::new();
    let marker = "extern \"C\" __global__ void ";
    let starts: Vec<usize> = SOURCE.match_indices(marker).map(|(i, _)| i).collect();
    for (n, &at) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(SOURCE.len());
        let text = &SOURCE[at + marker.len()..end];
        let open = text.find('(').expect("a parameter list");
        let close = text.find(')').expect("a closed parameter list");
        let params = text[open + 1..close]
            .split(',')
            .map(|p| {
                p.trim()
                    .rsplit(|c: char| c.is_whitespace() || c == '*')
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        out.push((
            text[..open].trim().to_string(),
            params,
            text[close..].to_string(),
        ));
    }
    out
}

/// The parameters (by index) of each kernel of the source that it adds into with
/// `atomicAdd` (its global-memory accumulators; the shared-memory ones are its own),
/// by entry. Panics on an `atomicAdd` it cannot attribute (outside a kernel's own body,
/// or into neither a parameter nor a `__shared__` array of that kernel), so a kernel
/// rewritten another way fails the tests that use this instead of escaping them.
pub(crate) fn accumulated_params() -> Vec<(String, Vec<usize>)> {
    let entries = entries();
    let in_bodies: usize = entries
        .iter()
        .map(|(_, _, body)| body.matches("atomicAdd(").count())
        .sum();
    assert_eq!(
        in_bodies,
        SOURCE.matches("atomicAdd(").count(),
        "an atomicAdd outside a kernel's body: attribute it to a kernel's parameters"
    );
    entries
        .into_iter()
        .map(|(entry, params, body)| {
            let mut targets = Vec::new();
            for (at, _) in body.match_indices("atomicAdd(") {
                let arg = body[at + "atomicAdd(".len()..].trim_start();
                let arg = arg.strip_prefix('&').unwrap_or(arg).trim_start();
                let name: String = arg
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if let Some(i) = params.iter().position(|p| *p == name) {
                    if !targets.contains(&i) {
                        targets.push(i);
                    }
                } else {
                    assert!(
                        body.contains(&format!("__shared__ float {name}[")),
                        "{entry}: atomicAdd into `{name}`, neither a parameter nor shared"
                    );
                }
            }
            (entry, targets)
        })
        .collect()
}
