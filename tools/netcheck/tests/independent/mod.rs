#![allow(dead_code)]
//! Independent f64 reference for small ResNets, built on `candle-core` (CPU) autograd.
//!
//! This module deliberately shares no code with this repository's crates: it is the
//! oracle that our own network executor is compared against. Include it from an
//! integration test with `mod independent;` (it lives at `tests/independent/mod.rs`).
//!
//! Semantics (torchvision ResNet v1.5 style, convolutions without bias, BatchNorm in
//! training mode):
//! - stem: conv → BN → ReLU (`stem.out`), then an optional max-pool (`stem.pool`);
//! - basic block: conv1 3×3/stride → BN → ReLU → conv2 3×3/1 → BN;
//! - bottleneck block: conv1 1×1/1 → BN → ReLU → conv2 3×3/stride → BN → ReLU →
//!   conv3 1×1/1 → BN;
//! - shortcut: identity, or `down` = conv 1×1/stride → BN; block output
//!   `relu(bn_last + shortcut)` (`s{i}.b{j}.out`);
//! - head: global average pool (`pooled`), FC (`logits`), mean softmax cross-entropy (`loss`).
//!
//! Conventions that matter when comparing against another executor:
//! - ReLU's derivative at exactly 0 is 0 (PyTorch/cuDNN convention; candle's own `relu`
//!   uses 1 there, so it is not used).
//! - Max-pool pads with −∞ (padding never wins) and, on ties, forward selects and
//!   backward routes the whole gradient to the FIRST maximum in window order
//!   (kernel row outer, kernel column inner, i.e. row-major over the window).
//!
//! Interface layouts are this repository's: activations NHWC, conv weights KRSC
//! (`[out, kernel_h, kernel_w, in]`), per-channel vectors `[C]`, all contiguous f64.
//! Internally everything runs in candle's NCHW / KCRS layouts; conversion happens only at
//! the boundary, inside the autograd graph for weights (so weight gradients come back KRSC).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var};

/// Named flat f64 buffers: parameters, forward values or gradients.
pub type Named = BTreeMap<String, Vec<f64>>;

/// A small ResNet description.
#[derive(Debug, Clone)]
pub struct RefNet {
    /// Channels of the input images.
    pub in_channels: usize,
    /// Input height = width.
    pub hw: usize,
    /// The stem (conv, BN, ReLU, optional max-pool).
    pub stem: RefStem,
    /// `stages[i][j]` is block `j` of stage `i` (layer names `s{i}.b{j}.*`).
    pub stages: Vec<Vec<RefBlock>>,
    /// Number of classes of the FC head.
    pub classes: usize,
    /// BatchNorm epsilon.
    pub epsilon: f64,
    /// Weight of the NEW batch statistic in the running statistics (PyTorch momentum).
    pub momentum: f64,
}

/// The stem: conv (`in_channels → out`), BN, ReLU, then an optional max-pool.
#[derive(Debug, Clone)]
pub struct RefStem {
    /// Output channels of the stem conv.
    pub out: usize,
    /// Square kernel size of the stem conv.
    pub kernel: usize,
    /// Stride of the stem conv.
    pub stride: usize,
    /// Zero padding of the stem conv (each side).
    pub pad: usize,
    /// Optional max-pool after the stem ReLU.
    pub max_pool: Option<RefPool>,
}

/// Max-pool geometry (square window); padding is −∞ and never selected.
#[derive(Debug, Clone)]
pub struct RefPool {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding on each side; must be smaller than `kernel`.
    pub pad: usize,
}

/// Residual block flavor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefBlockKind {
    /// Two 3×3 convs (stride on the first).
    Basic,
    /// 1×1, 3×3 (stride here, v1.5), 1×1.
    Bottleneck,
}

/// One residual block.
#[derive(Debug, Clone)]
pub struct RefBlock {
    /// Block flavor.
    pub kind: RefBlockKind,
    /// Input channels.
    pub in_ch: usize,
    /// Inner width (output channels of conv1, and of conv2 for bottlenecks).
    pub width: usize,
    /// Output channels.
    pub out: usize,
    /// Spatial stride of the block.
    pub stride: usize,
    /// `true`: shortcut is `down` (1×1/stride conv + BN); `false`: identity
    /// (requires `in_ch == out` and `stride == 1`).
    pub projection: bool,
}

/// Result of one reference training step (forward + backward).
#[derive(Debug, Clone)]
pub struct RefRun {
    /// Forward values (see [`run`] for the keys).
    pub forward: Named,
    /// Gradients of the loss (see [`run`] for the keys).
    pub grads: Named,
}

/// One convolution layer (each is followed by its own BatchNorm).
#[derive(Debug, Clone)]
struct ConvSpec {
    name: String,
    cin: usize,
    cout: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
}

fn conv(name: String, cin: usize, cout: usize, kernel: usize, stride: usize) -> ConvSpec {
    ConvSpec {
        name,
        cin,
        cout,
        kernel,
        stride,
        pad: kernel / 2,
    }
}

/// The conv layers of block `s{i}.b{j}` in execution order: main path, then `down`.
fn block_convs(i: usize, j: usize, b: &RefBlock) -> Vec<ConvSpec> {
    let p = format!("s{i}.b{j}");
    let mut v = match b.kind {
        RefBlockKind::Basic => vec![
            conv(format!("{p}.conv1"), b.in_ch, b.width, 3, b.stride),
            conv(format!("{p}.conv2"), b.width, b.out, 3, 1),
        ],
        RefBlockKind::Bottleneck => vec![
            conv(format!("{p}.conv1"), b.in_ch, b.width, 1, 1),
            conv(format!("{p}.conv2"), b.width, b.width, 3, b.stride),
            conv(format!("{p}.conv3"), b.width, b.out, 1, 1),
        ],
    };
    if b.projection {
        v.push(conv(format!("{p}.down"), b.in_ch, b.out, 1, b.stride));
    }
    v
}

fn stem_conv(net: &RefNet) -> ConvSpec {
    ConvSpec {
        name: "stem".into(),
        cin: net.in_channels,
        cout: net.stem.out,
        kernel: net.stem.kernel,
        stride: net.stem.stride,
        pad: net.stem.pad,
    }
}

/// Every conv layer of the net, stem first, blocks in order.
fn all_convs(net: &RefNet) -> Vec<ConvSpec> {
    let mut v = vec![stem_conv(net)];
    for (i, stage) in net.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            v.extend(block_convs(i, j, b));
        }
    }
    v
}

/// Channels entering the head (last block's `out`, or the stem's if there are no blocks).
fn features(net: &RefNet) -> usize {
    net.stages
        .iter()
        .flatten()
        .last()
        .map_or(net.stem.out, |b| b.out)
}

/// Every parameter with its shape: `{L}.w` `[K, R, S, C]` (KRSC), `{L}.gamma`, `{L}.beta`,
/// `{L}.running_mean`, `{L}.running_var` `[K]` for every conv layer `L` (stem first, then
/// blocks in order), then `fc.w` `[classes, features]` and `fc.b` `[classes]`.
pub fn param_shapes(net: &RefNet) -> Vec<(String, Vec<usize>)> {
    let mut v = Vec::new();
    for c in all_convs(net) {
        v.push((
            format!("{}.w", c.name),
            vec![c.cout, c.kernel, c.kernel, c.cin],
        ));
        for s in ["gamma", "beta", "running_mean", "running_var"] {
            v.push((format!("{}.{s}", c.name), vec![c.cout]));
        }
    }
    v.push(("fc.w".into(), vec![net.classes, features(net)]));
    v.push(("fc.b".into(), vec![net.classes]));
    v
}

/// Output extent of a window op, or `None` if the window does not fit.
fn out_extent(len: usize, kernel: usize, stride: usize, pad: usize) -> Option<usize> {
    let padded = len + 2 * pad;
    if kernel == 0 || stride == 0 || padded < kernel {
        None
    } else {
        Some((padded - kernel) / stride + 1)
    }
}

/// Checks the net's structure and returns the smallest spatial extent (height = width)
/// that any BatchNorm sees.
fn validate_net(net: &RefNet) -> Result<usize, String> {
    if net.in_channels == 0 || net.hw == 0 || net.classes == 0 || net.stem.out == 0 {
        return Err("in_channels, hw, classes and stem.out must be positive".into());
    }
    if !(net.epsilon > 0.0 && net.epsilon.is_finite()) {
        return Err(format!(
            "epsilon must be positive and finite, got {}",
            net.epsilon
        ));
    }
    if !(0.0..=1.0).contains(&net.momentum) {
        return Err(format!("momentum must be in [0, 1], got {}", net.momentum));
    }
    let s = &net.stem;
    let mut h = out_extent(net.hw, s.kernel, s.stride, s.pad).ok_or_else(|| {
        format!(
            "stem conv kernel {} stride {} pad {} does not fit input {}",
            s.kernel, s.stride, s.pad, net.hw
        )
    })?;
    let mut min_h = h;
    if let Some(p) = &s.max_pool {
        if p.pad >= p.kernel {
            return Err(format!(
                "max-pool pad {} must be smaller than its kernel {}",
                p.pad, p.kernel
            ));
        }
        h = out_extent(h, p.kernel, p.stride, p.pad).ok_or_else(|| {
            format!(
                "max-pool kernel {} stride {} pad {} does not fit {h}",
                p.kernel, p.stride, p.pad
            )
        })?;
    }
    let mut ch = s.out;
    for (i, stage) in net.stages.iter().enumerate() {
        for (j, b) in stage.iter().enumerate() {
            if b.in_ch != ch {
                return Err(format!(
                    "s{i}.b{j}: in_ch {} but the previous layer produces {ch} channels",
                    b.in_ch
                ));
            }
            if b.width == 0 || b.out == 0 || b.stride == 0 {
                return Err(format!("s{i}.b{j}: width, out and stride must be positive"));
            }
            if !b.projection && (b.in_ch != b.out || b.stride != 1) {
                return Err(format!(
                    "s{i}.b{j}: identity shortcut needs in_ch == out and stride 1 \
                     (in_ch {}, out {}, stride {})",
                    b.in_ch, b.out, b.stride
                ));
            }
            for c in block_convs(i, j, b) {
                // Every conv of a block sees either the block input extent or, after the
                // strided conv, the output extent; check the strided one on the input.
                if out_extent(h, c.kernel, c.stride, c.pad).is_none() {
                    return Err(format!("{}: window does not fit extent {h}", c.name));
                }
            }
            // Every BN of the block sees the input extent or the strided one (smaller).
            h = (h - 1) / b.stride + 1;
            min_h = min_h.min(h);
            ch = b.out;
        }
    }
    Ok(min_h)
}

fn validate_inputs(
    net: &RefNet,
    params: &Named,
    images: &[f64],
    labels: &[usize],
) -> Result<(), String> {
    let min_h = validate_net(net)?;
    let n = labels.len();
    if n == 0 {
        return Err("empty batch (no labels)".into());
    }
    let per_image = net.hw * net.hw * net.in_channels;
    if images.len() != n * per_image {
        return Err(format!(
            "images has {} values, expected {n} images × {}×{}×{} = {}",
            images.len(),
            net.hw,
            net.hw,
            net.in_channels,
            n * per_image
        ));
    }
    if let Some((i, l)) = labels.iter().enumerate().find(|(_, &l)| l >= net.classes) {
        return Err(format!(
            "label[{i}] = {l} is not below classes = {}",
            net.classes
        ));
    }
    if n * min_h * min_h < 2 {
        return Err(format!(
            "a BatchNorm would see {} value(s) per channel; training-mode BN needs at least 2",
            n * min_h * min_h
        ));
    }
    for (name, dims) in param_shapes(net) {
        let want: usize = dims.iter().product();
        match params.get(&name) {
            None => return Err(format!("missing parameter {name} (shape {dims:?})")),
            Some(v) if v.len() != want => {
                return Err(format!(
                    "parameter {name} has {} values, expected {want} (shape {dims:?})",
                    v.len()
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Runs one training step of `net` in f64: forward in BN training mode, loss, backward.
///
/// `params` must hold every name of [`param_shapes`] with the matching length (extra names
/// are ignored). `images` is NHWC `[N, hw, hw, in_channels]` with `N = labels.len()`;
/// `labels` are class indices.
///
/// `forward` holds, for every conv layer `L`: `{L}.x` (conv input, NHWC), `{L}.y` (raw conv
/// output, NHWC), `{L}.mean` (batch mean), `{L}.var` (biased batch variance), `{L}.inv_std`
/// (`1/sqrt(var + eps)`), `{L}.running_mean_next`, `{L}.running_var_next`; and `stem.out`,
/// `stem.pool` (if pooled), every `s{i}.b{j}.out` (NHWC), `pooled` `[N, features]`, `logits`
/// `[N, classes]`, `loss` (1 value).
///
/// `grads` (d loss / d ·) holds `{L}.w` (KRSC), `{L}.gamma`, `{L}.beta`, `{L}.y` (NHWC) for
/// every conv `L`; `fc.w`, `fc.b`; `stem.out`, every `s{i}.b{j}.out` (NHWC), `pooled`, `logits`.
///
/// Bad input (structure, missing or mis-sized parameters, labels) gives `Err` naming the
/// problem; it never panics.
pub fn run(
    net: &RefNet,
    params: &Named,
    images: &[f64],
    labels: &[usize],
) -> Result<RefRun, String> {
    validate_inputs(net, params, images, labels)?;
    match catch_unwind(AssertUnwindSafe(|| {
        Step::new(net, params).execute(images, labels, true)
    })) {
        Ok(r) => r.map_err(|e| format!("candle error: {e}")),
        Err(_) => Err("internal panic in the reference (please report)".into()),
    }
}

/// The forward pass of `net` in f64 with BatchNorm in **evaluation mode**: every BN
/// normalizes with its layer's running statistics (`{L}.running_mean`, `{L}.running_var`,
/// read from `params`) written from tensor ops, `(y − running_mean) / sqrt(running_var + ε)
/// · γ + β`; no batch statistic is computed. `images` is NHWC `[n, hw, hw, in_channels]`.
///
/// Returns the forward values as [`run`] names them (`logits`, `pooled`, `stem.out`, every
/// `s{i}.b{j}.out`, each layer's `{L}.x` and `{L}.y`), without the batch statistics.
///
/// Bad input gives `Err` naming the problem; it never panics.
pub fn eval(net: &RefNet, params: &Named, images: &[f64], n: usize) -> Result<Named, String> {
    // Labels only feed the (ignored) loss; at least two values per channel, as `run` checks,
    // is asked of eval batches too (the reference's validation is shared).
    let labels = vec![0; n];
    validate_inputs(net, params, images, &labels)?;
    for name in param_shapes(net)
        .iter()
        .filter_map(|(n, _)| n.strip_suffix(".gamma"))
    {
        for stat in ["running_mean", "running_var"] {
            if !params.contains_key(&format!("{name}.{stat}")) {
                return Err(format!("missing {name}.{stat} (evaluation mode reads it)"));
            }
        }
    }
    match catch_unwind(AssertUnwindSafe(|| {
        let mut st = Step::new(net, params);
        st.eval = true;
        st.execute(images, &labels, false)
    })) {
        Ok(r) => r
            .map_err(|e| format!("candle error: {e}"))
            .map(|r| r.forward),
        Err(_) => Err("internal panic in the reference (please report)".into()),
    }
}

/// The loss alone (forward only, no backward): the same value as `run(..)?.forward["loss"]`.
/// Meant for finite differences.
pub fn loss(net: &RefNet, params: &Named, images: &[f64], labels: &[usize]) -> Result<f64, String> {
    validate_inputs(net, params, images, labels)?;
    match catch_unwind(AssertUnwindSafe(|| {
        Step::new(net, params).execute(images, labels, false)
    })) {
        Ok(r) => r
            .map_err(|e| format!("candle error: {e}"))
            .map(|r| r.forward["loss"][0]),
        Err(_) => Err("internal panic in the reference (please report)".into()),
    }
}

/// Layout of a tapped tensor, for converting its gradient at the boundary.
#[derive(Clone, Copy)]
enum Tap {
    /// `[N, C, H, W]`, reported NHWC.
    Nchw,
    /// Reported as is (row-major).
    Flat,
}

/// Graph-building state of one step.
struct Step<'a> {
    net: &'a RefNet,
    params: &'a Named,
    dev: Device,
    forward: Named,
    /// Trainable parameters: name and variable (gradient reported as is).
    vars: Vec<(String, Var)>,
    /// Zero-valued variables added onto intermediates: candle keeps gradients only for
    /// variables, and d loss / d tap = d loss / d (intermediate).
    taps: Vec<(String, Var, Tap)>,
    /// BatchNorm in evaluation mode (running statistics) instead of training mode.
    eval: bool,
}

type CResult<T> = candle_core::Result<T>;

/// NCHW tensor → flat NHWC values.
fn nhwc_vec(t: &Tensor) -> CResult<Vec<f64>> {
    t.permute((0, 2, 3, 1))?.flatten_all()?.to_vec1::<f64>()
}

fn flat_vec(t: &Tensor) -> CResult<Vec<f64>> {
    t.flatten_all()?.to_vec1::<f64>()
}

/// ReLU with derivative 0 at 0: `x · [x > 0]` with the mask outside the graph.
pub fn relu(x: &Tensor) -> CResult<Tensor> {
    let mask = x.gt(0.0)?.to_dtype(DType::F64)?.detach();
    x.mul(&mask)
}

impl<'a> Step<'a> {
    fn new(net: &'a RefNet, params: &'a Named) -> Self {
        Step {
            net,
            params,
            dev: Device::Cpu,
            forward: Named::new(),
            vars: Vec::new(),
            taps: Vec::new(),
            eval: false,
        }
    }

    fn execute(mut self, images: &[f64], labels: &[usize], backward: bool) -> CResult<RefRun> {
        let net = self.net;
        let st = &mut self;
        let n = labels.len();
        let x = Tensor::from_slice(images, (n, net.hw, net.hw, net.in_channels), &st.dev)?
            .permute((0, 3, 1, 2))?
            .contiguous()?;

        let stem = stem_conv(net);
        let y = st.conv_bn(&stem, &x)?;
        let y = st.tap("stem.out", relu(&y)?, Tap::Nchw)?;
        let mut cur = match &net.stem.max_pool {
            Some(p) => {
                let pooled = max_pool2d(&y, p)?;
                st.forward.insert("stem.pool".into(), nhwc_vec(&pooled)?);
                pooled
            }
            None => y,
        };

        for (i, stage) in net.stages.iter().enumerate() {
            for (j, b) in stage.iter().enumerate() {
                let convs = block_convs(i, j, b);
                let main_len = if b.projection {
                    convs.len() - 1
                } else {
                    convs.len()
                };
                let mut h = cur.clone();
                for (k, c) in convs[..main_len].iter().enumerate() {
                    h = st.conv_bn(c, &h)?;
                    if k + 1 < main_len {
                        h = relu(&h)?;
                    }
                }
                let short = if b.projection {
                    st.conv_bn(&convs[main_len], &cur)?
                } else {
                    cur.clone()
                };
                let out = relu(&(h + short)?)?;
                cur = st.tap(&format!("s{i}.b{j}.out"), out, Tap::Nchw)?;
            }
        }

        let pooled = st.tap("pooled", cur.mean((2, 3))?, Tap::Flat)?;
        let fc_w = st.param("fc.w", (net.classes, features(net)))?;
        let fc_b = st.param("fc.b", net.classes)?;
        let logits = pooled.matmul(&fc_w.t()?)?.broadcast_add(&fc_b)?;
        let logits = st.tap("logits", logits, Tap::Flat)?;

        // Mean softmax cross-entropy. The max shift is a constant for autograd
        // (log-softmax is shift invariant), so it is detached.
        let shift = logits.max_keepdim(1)?.detach();
        let z = logits.broadcast_sub(&shift)?;
        let log_sum = z.exp()?.sum_keepdim(1)?.log()?;
        let log_p = z.broadcast_sub(&log_sum)?;
        let mut one_hot = vec![0.0f64; n * net.classes];
        for (r, &l) in labels.iter().enumerate() {
            one_hot[r * net.classes + l] = 1.0;
        }
        let one_hot = Tensor::from_vec(one_hot, (n, net.classes), &st.dev)?;
        let loss = (log_p.mul(&one_hot)?.sum_all()? * (-1.0 / n as f64))?;
        st.forward
            .insert("loss".into(), vec![loss.to_scalar::<f64>()?]);

        let mut grads = Named::new();
        if backward {
            let store = loss.backward()?;
            let get = |v: &Var| -> CResult<Tensor> {
                match store.get(v.as_tensor()) {
                    Some(g) => Ok(g.clone()),
                    None => v.as_tensor().zeros_like(),
                }
            };
            for (name, v) in &st.vars {
                grads.insert(name.clone(), flat_vec(&get(v)?)?);
            }
            for (name, v, kind) in &st.taps {
                let g = get(v)?;
                let g = match kind {
                    Tap::Nchw => nhwc_vec(&g)?,
                    Tap::Flat => flat_vec(&g)?,
                };
                grads.insert(name.clone(), g);
            }
        }
        Ok(RefRun {
            forward: std::mem::take(&mut st.forward),
            grads,
        })
    }

    fn values(&self, name: &str) -> CResult<&'a [f64]> {
        match self.params.get(name) {
            Some(v) => Ok(v),
            None => candle_core::bail!("missing parameter {name}"),
        }
    }

    /// A trainable parameter as a variable of the given shape.
    fn param<S: Into<Shape>>(&mut self, name: &str, shape: S) -> CResult<Tensor> {
        let v = Var::from_slice(self.values(name)?, shape, &self.dev)?;
        let t = v.as_tensor().clone();
        self.vars.push((name.to_string(), v));
        Ok(t)
    }

    /// Records `t`'s value under `name` (if NCHW) and adds a zero variable onto it so that
    /// its gradient can be read back.
    fn tap(&mut self, name: &str, t: Tensor, kind: Tap) -> CResult<Tensor> {
        let values = match kind {
            Tap::Nchw => nhwc_vec(&t)?,
            Tap::Flat => flat_vec(&t)?,
        };
        self.forward.insert(name.to_string(), values);
        let zero = Var::zeros(t.shape(), DType::F64, &self.dev)?;
        let out = t.add(zero.as_tensor())?;
        self.taps.push((name.to_string(), zero, kind));
        Ok(out)
    }

    /// conv (no bias) → BatchNorm (training mode); records the layer's forward values.
    fn conv_bn(&mut self, c: &ConvSpec, x: &Tensor) -> CResult<Tensor> {
        let name = &c.name;
        self.forward.insert(format!("{name}.x"), nhwc_vec(x)?);
        let w = self.param(&format!("{name}.w"), (c.cout, c.kernel, c.kernel, c.cin))?;
        let kernel = w.permute((0, 3, 1, 2))?.contiguous()?; // KRSC → KCRS
        let y = x.conv2d(&kernel, c.pad, c.stride, 1, 1)?;
        let y = self.tap(&format!("{name}.y"), y, Tap::Nchw)?;

        let gamma = self.param(&format!("{name}.gamma"), c.cout)?;
        let beta = self.param(&format!("{name}.beta"), c.cout)?;
        if self.eval {
            // Evaluation mode: the running statistics, as constants of the graph.
            let stat = |s: &Self, what: &str| -> CResult<Tensor> {
                Tensor::from_slice(
                    s.values(&format!("{name}.{what}"))?,
                    (1, c.cout, 1, 1),
                    &s.dev,
                )
            };
            let rm = stat(self, "running_mean")?;
            let rv = stat(self, "running_var")?;
            let inv_std = rv.affine(1.0, self.net.epsilon)?.sqrt()?.recip()?;
            return y
                .broadcast_sub(&rm)?
                .broadcast_mul(&inv_std)?
                .broadcast_mul(&gamma.reshape((1, c.cout, 1, 1))?)?
                .broadcast_add(&beta.reshape((1, c.cout, 1, 1))?);
        }
        let mean = y.mean_keepdim((0, 2, 3))?;
        let centered = y.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim((0, 2, 3))?;
        let inv_std = var.affine(1.0, self.net.epsilon)?.sqrt()?.recip()?;
        let out = centered
            .broadcast_mul(&inv_std)?
            .broadcast_mul(&gamma.reshape((1, c.cout, 1, 1))?)?
            .broadcast_add(&beta.reshape((1, c.cout, 1, 1))?)?;

        let (n, _, h, w_) = y.dims4()?;
        let m = (n * h * w_) as f64;
        let mean_v = flat_vec(&mean)?;
        let var_v = flat_vec(&var)?;
        let mom = self.net.momentum;
        let rm = self.values(&format!("{name}.running_mean"))?;
        let rv = self.values(&format!("{name}.running_var"))?;
        let rm_next: Vec<f64> = rm
            .iter()
            .zip(&mean_v)
            .map(|(r, b)| (1.0 - mom) * r + mom * b)
            .collect();
        let rv_next: Vec<f64> = rv
            .iter()
            .zip(&var_v)
            .map(|(r, b)| (1.0 - mom) * r + mom * b * m / (m - 1.0))
            .collect();
        self.forward
            .insert(format!("{name}.inv_std"), flat_vec(&inv_std)?);
        self.forward.insert(format!("{name}.mean"), mean_v);
        self.forward.insert(format!("{name}.var"), var_v);
        self.forward
            .insert(format!("{name}.running_mean_next"), rm_next);
        self.forward
            .insert(format!("{name}.running_var_next"), rv_next);
        Ok(out)
    }
}

/// Max-pool over an NCHW f64 tensor as a candle custom op with explicit loops.
///
/// Padding is −∞ (never selected; `pad < kernel` guarantees every window has a real
/// element). Tie rule: forward selects, and backward sends the whole gradient to, the FIRST
/// maximum in window order: kernel row outer, kernel column inner (row-major over the
/// window). A NaN counts as a maximum (the first NaN wins), so NaN propagates.
#[derive(Debug, Clone)]
pub struct MaxPool {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding on each side.
    pub pad: usize,
}

/// Applies [`MaxPool`] with the geometry of `pool` to an NCHW f64 tensor (differentiable).
pub fn max_pool2d(x: &Tensor, pool: &RefPool) -> CResult<Tensor> {
    x.contiguous()?.apply_op1(MaxPool {
        kernel: pool.kernel,
        stride: pool.stride,
        pad: pool.pad,
    })
}

impl MaxPool {
    fn geometry(&self, h: usize, w: usize) -> CResult<(usize, usize)> {
        if self.pad >= self.kernel {
            candle_core::bail!("max-pool pad {} >= kernel {}", self.pad, self.kernel)
        }
        match (
            out_extent(h, self.kernel, self.stride, self.pad),
            out_extent(w, self.kernel, self.stride, self.pad),
        ) {
            (Some(oh), Some(ow)) => Ok((oh, ow)),
            _ => candle_core::bail!("max-pool window does not fit {h}×{w}"),
        }
    }

    /// Index (into the `h×w` plane) of the selected element of window `(oy, ox)`.
    fn select(&self, plane: &[f64], h: usize, w: usize, oy: usize, ox: usize) -> usize {
        let mut best: Option<(usize, f64)> = None;
        for ky in 0..self.kernel {
            let iy = (oy * self.stride + ky) as isize - self.pad as isize;
            if iy < 0 || iy >= h as isize {
                continue;
            }
            for kx in 0..self.kernel {
                let ix = (ox * self.stride + kx) as isize - self.pad as isize;
                if ix < 0 || ix >= w as isize {
                    continue;
                }
                let idx = iy as usize * w + ix as usize;
                let v = plane[idx];
                let better = match best {
                    None => true,
                    Some((_, b)) => !b.is_nan() && (v > b || v.is_nan()),
                };
                if better {
                    best = Some((idx, v));
                }
            }
        }
        // pad < kernel guarantees a real element in every window (checked in geometry).
        best.map_or(0, |(i, _)| i)
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "reference-max-pool2d"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> CResult<(CpuStorage, Shape)> {
        let CpuStorage::F64(data) = storage else {
            candle_core::bail!("reference max-pool supports f64 only")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("reference max-pool needs a contiguous input")
        };
        let (n, c, h, w) = layout.shape().dims4()?;
        let (oh, ow) = self.geometry(h, w)?;
        let data = &data[start..end];
        let mut out = Vec::with_capacity(n * c * oh * ow);
        for plane in data.chunks_exact(h * w) {
            for oy in 0..oh {
                for ox in 0..ow {
                    out.push(plane[self.select(plane, h, w, oy, ox)]);
                }
            }
        }
        Ok((CpuStorage::F64(out), Shape::from((n, c, oh, ow))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> CResult<Option<Tensor>> {
        let (n, c, h, w) = arg.dims4()?;
        let (oh, ow) = self.geometry(h, w)?;
        let x = flat_vec(arg)?;
        let g = flat_vec(grad_res)?;
        if g.len() != n * c * oh * ow {
            candle_core::bail!("reference max-pool backward: gradient has the wrong size")
        }
        let mut dx = vec![0.0f64; x.len()];
        for (p, plane) in x.chunks_exact(h * w).enumerate() {
            for oy in 0..oh {
                for ox in 0..ow {
                    let idx = self.select(plane, h, w, oy, ox);
                    dx[p * h * w + idx] += g[(p * oh + oy) * ow + ox];
                }
            }
        }
        Ok(Some(Tensor::from_vec(dx, (n, c, h, w), arg.device())?))
    }
}
