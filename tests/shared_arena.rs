//! The liveness-planned arena on the CPU executor (tier 1: no GPU, no cuDNN): a network run
//! with its step-long buffers in the shared arena ([`Arena::Shared`]) gives the same results,
//! bit for bit, as one vector per buffer, on every preset and route, in training and in
//! evaluation mode, over two steps (so a value left over from the previous step would show);
//! the arena is far smaller than one slot each; and a buffer read after its lifetime is a
//! typed error naming the buffer that took its place.

use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::net::{Arena, BufferRole, CpuNet};
use cudnn_cbr::{net::compile, net::Preset, net::RoutePolicy};
use half::f16;

/// Deterministic values in [-1, 1), rounded to FP16.
fn values(n: usize, seed: u64) -> Vec<f16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            f16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

/// Bits of every buffer a step leaves for the caller (parameter gradients, running
/// statistics, the output): the buffers of their own in both layouts.
fn kept(net: &CpuNet<f16>) -> Vec<(String, Vec<u64>)> {
    let c = net.net();
    c.buffers
        .iter()
        .enumerate()
        .filter(|(id, b)| {
            matches!(b.role, BufferRole::ParamGrad | BufferRole::Running) || *id == c.output
        })
        .map(|(_, b)| {
            let bits = net
                .values(&b.name)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (b.name.clone(), bits)
        })
        .collect()
}

/// Weights for every layer (the same for both layouts), two training steps and an
/// evaluation; the bits after each.
fn run(net: &mut CpuNet<f16>) -> Vec<Vec<(String, Vec<u64>)>> {
    let c = net.net();
    let (images, out) = (c.buffers[c.input].elems, c.buffers[c.output].elems);
    let params: Vec<(String, usize, bool)> = c
        .buffers
        .iter()
        .filter(|b| b.role == BufferRole::Param)
        .map(|b| {
            (
                b.name.clone(),
                b.elems,
                b.dtype == cudnn_cbr::runtime::DataType::Half,
            )
        })
        .collect();
    for (i, (name, elems, half)) in params.into_iter().enumerate() {
        let v = values(elems, 100 + i as u64);
        if half {
            // He-like scale keeps activations in FP16 range through deep networks.
            let scale = (2.0 / elems.max(1) as f32).sqrt() * 8.0;
            net.set_half(
                &name,
                v.iter()
                    .map(|x| f16::from_f32(x.to_f32() * scale))
                    .collect(),
            )
            .unwrap();
        } else if name.ends_with("gamma") {
            net.set_float(&name, v.iter().map(|x| 1.0 + 0.1 * x.to_f32()).collect())
                .unwrap();
        } else {
            net.set_float(&name, v.iter().map(|x| 0.1 * x.to_f32()).collect())
                .unwrap();
        }
    }
    let mut out_bits = Vec::new();
    for step in 0..2u64 {
        net.forward(&values(images, 7 + step)).unwrap();
        net.backward(values(out, 11 + step)).unwrap();
        out_bits.push(kept(net));
    }
    net.evaluate(&values(images, 13)).unwrap();
    out_bits.push(kept(net));
    out_bits
}

#[test]
fn the_shared_arena_gives_the_same_bits_on_every_preset_and_route() {
    for preset in Preset::ALL {
        for route in [RouteKind::Fused, RouteKind::Unfused, RouteKind::Generic] {
            let (batch, hw) = if preset == Preset::Mini {
                (2, 8)
            } else {
                (2, 32)
            };
            let what = format!("{} {route:?}", preset.name());
            let compiled = || {
                compile(
                    &preset.spec(3, 10, 8),
                    batch,
                    hw,
                    &RoutePolicy::Uniform(route),
                )
                .unwrap()
            };
            let mut separate = CpuNet::<f16>::with_arena(compiled(), Arena::Separate).unwrap();
            let mut shared = CpuNet::<f16>::with_arena(compiled(), Arena::Shared).unwrap();
            let a = run(&mut separate);
            let b = run(&mut shared);
            for (step, (x, y)) in a.iter().zip(&b).enumerate() {
                for ((name, u), (_, v)) in x.iter().zip(y) {
                    assert!(u == v, "{what}: `{name}` differs after pass {step}");
                }
            }
            // The arena is smaller than one slot per buffer it holds (activation gradients
            // die as the backward pass goes, stored activations as it reads them).
            let net = shared.net();
            let held: usize = net
                .buffers
                .iter()
                .enumerate()
                .filter(|(id, b)| {
                    matches!(
                        b.role,
                        BufferRole::Activation | BufferRole::Gradient | BufferRole::Scratch
                    ) && ![net.input, net.output, net.output_grad].contains(id)
                })
                .map(|(_, b)| b.elems)
                .sum();
            let (h, f) = shared.arena_elems();
            assert!(
                (h + f) * 10 < held * 7,
                "{what}: arena {} elements, one slot each {held}",
                h + f
            );
        }
    }
}

#[test]
fn a_buffer_read_after_its_lifetime_is_a_typed_error_naming_its_successor() {
    let net = compile(
        &Preset::ResNet18.spec(3, 10, 8),
        2,
        32,
        &RoutePolicy::Uniform(RouteKind::Fused),
    )
    .unwrap();
    let mut shared = CpuNet::<f16>::with_arena(net, Arena::Shared).unwrap();
    run(&mut shared);
    // After the evaluation, the first stage's activation gradients were overwritten by
    // activations of the evaluation's forward pass (they share bytes), so reading one names
    // the buffer that took its place; a buffer of its own still reads.
    let c = shared.net();
    let mut stale = 0;
    for b in &c.buffers {
        if b.role != BufferRole::Gradient || b.dtype != cudnn_cbr::runtime::DataType::Half {
            continue;
        }
        match shared.half(&b.name) {
            Ok(_) => {}
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains(&b.name) && e.contains("was overwritten by `"),
                    "{e}"
                );
                stale += 1;
            }
        }
    }
    assert!(stale > 0, "no gradient buffer was reused");
    assert!(shared.half(&c.buffers[c.input].name).is_ok());
}
