//! Every layer shape and network the GPU tests and GPU benches run, in one place: each of
//! them reads its entry here, and tests/planned_gpu_shapes.rs (and, for the trainer's
//! networks, crates/6-trainer/tests/planned_default_nets.rs) plans every entry deviceless on the H200
//! fixture in CI, so a shape added to a GPU test has been planned before it meets a device.
//!
//! Included as `common::gpu_shapes` by the tests and with `#[path]` by the benches and the
//! trainer's tests.
#![allow(dead_code)]

use cudnn_cbr::fusion::cbr::{resnet50, CbrConfig, ConvShape};
use cudnn_cbr::net::{BlockKind, BlockSpec, NetSpec, PoolSpec, Preset, StemSpec};

/// tests/gpu_own_kernels.rs: (first layer, second layer) pairs. The first is
/// `CbrConfig::first`, the second takes its BN as prologue and adds a residual
/// (`ApplyResidual::Add`); both on the fused route only, with our kernels and with cuDNN's
/// graphs. 64 channels: the 16-byte path; a 3-channel first conv: its statistics on our
/// kernel. The second pair's layers have 24 output channels, not 20: on the H200 fixture
/// (cuDNN 9.28) the second layer's prologue graph (`scale_bias_relu_conv_genstats`) has no
/// engine when its input or output channels are not a multiple of 8, so a 20-channel pair
/// cannot run the fused route there (tests/planned_gpu_shapes.rs found it).
pub fn own_kernels_pairs() -> [(ConvShape, ConvShape); 2] {
    [
        (
            ConvShape::square(4, 32, 14, 64, 3, 1, 1),
            ConvShape::square(4, 64, 14, 64, 3, 1, 1),
        ),
        (
            ConvShape::square(2, 3, 9, 24, 3, 1, 1),
            ConvShape::square(2, 24, 9, 24, 1, 0, 1),
        ),
    ]
}

/// tests/gpu_cbr_parity.rs: (first layer, second layer) pairs, the second without a residual
/// (`ApplyResidual::None`); each planned with fallbacks (`CbrLayer::plan`) and on the
/// unfused route only.
pub fn parity_pairs() -> [(ConvShape, ConvShape); 2] {
    [
        (
            ConvShape::square(8, 32, 28, 64, 3, 1, 1),
            ConvShape::square(8, 64, 28, 64, 3, 1, 1),
        ),
        (
            ConvShape::square(8, 64, 28, 64, 1, 0, 1),
            ConvShape::square(8, 64, 28, 128, 3, 1, 2),
        ),
    ]
}

/// tests/gpu_conv.rs: the conv fprop graph (and conv fprop + GenStats) planned with
/// `build_plan`.
pub fn conv_shape() -> ConvShape {
    ConvShape::square(4, 32, 16, 48, 3, 1, 1)
}

/// tests/gpu_network.rs: a stem and one bottleneck block with a projection, compiled on the
/// fused route (with fallbacks) and on the unfused route at [`NETWORK_BATCH_HW`].
pub fn network_spec() -> NetSpec {
    NetSpec {
        name: "stem + bottleneck".into(),
        in_channels: 8,
        stem: StemSpec {
            out: 32,
            kernel: 3,
            stride: 1,
            pad: 1,
            max_pool: None,
        },
        stages: vec![vec![BlockSpec::new(BlockKind::Bottleneck, 32, 16, 64, 2)]],
        classes: 4,
    }
}

/// (batch, input height = width) of [`network_spec`] in tests/gpu_network.rs.
pub const NETWORK_BATCH_HW: (usize, usize) = (8, 16);

/// tests/gpu_network.rs: ResNet's own stem (7×7/2 over 3 channels, then the 3×3/2 max-pool)
/// and two basic blocks with projections, at [`POOLED_NETWORK_BATCH_HW`]: the max-pool, the
/// strided 7×7 stem and the basic block's layers, which [`network_spec`] lacks.
pub fn pooled_network_spec() -> NetSpec {
    NetSpec {
        name: "resnet stem + max-pool + basic blocks".into(),
        in_channels: 3,
        stem: StemSpec {
            out: 16,
            kernel: 7,
            stride: 2,
            pad: 3,
            max_pool: Some(PoolSpec {
                kernel: 3,
                stride: 2,
                pad: 1,
            }),
        },
        stages: vec![
            vec![BlockSpec::new(BlockKind::Basic, 16, 32, 32, 2)],
            vec![BlockSpec::new(BlockKind::Basic, 32, 64, 64, 2)],
        ],
        classes: 4,
    }
}

/// (batch, input height = width) of [`pooled_network_spec`]: 32 → 16 (stem) → 8 (max-pool)
/// → 4 → 2, so the last stage normalizes over 2·2·2 = 8 values per channel.
pub const POOLED_NETWORK_BATCH_HW: (usize, usize) = (2, 32);

/// Every network tests/gpu_network.rs runs, with its (batch, height = width).
pub fn network_cases() -> [(NetSpec, (usize, usize)); 2] {
    [
        (network_spec(), NETWORK_BATCH_HW),
        (pooled_network_spec(), POOLED_NETWORK_BATCH_HW),
    ]
}

/// benches/cbr_layers.rs: the batch of a full run (`--bench`) and of a quick one (`cargo
/// test`), unless `CBR_BENCH_BATCH` says otherwise.
pub const CBR_LAYERS_BATCH_FULL: i64 = 256;
/// See [`CBR_LAYERS_BATCH_FULL`].
pub const CBR_LAYERS_BATCH_QUICK: i64 = 8;
/// How many of [`cbr_layers`]'s layers a quick run times.
pub const CBR_LAYERS_QUICK_LAYERS: usize = 2;

/// benches/cbr_layers.rs: ResNet-50's distinct layers at `batch`, each on the fused and the
/// unfused route only (no fallback) with our kernels, and on the fused route with cuDNN's
/// graphs.
pub fn cbr_layers(batch: i64) -> Vec<(&'static str, CbrConfig)> {
    resnet50::resnet50_layers(batch)
}

/// benches/cbr_layers.rs: the layers whose unfused route has no engine on the H200 fixture
/// (cuDNN 9.28: `batchnorm_dual_scale_bias_add_relu`, the block output joining the
/// projection's BN): the bench's unfused row of each is unavailable. Measured by
/// tests/planned_gpu_shapes.rs, which fails when this list stops matching.
pub const CBR_LAYERS_UNFUSED_NO_ENGINE: [&str; 4] =
    ["l1.conv3", "l2.conv3", "l3.conv3", "l4.conv3"];

/// benches/cbr_layers.rs: the two conv fprop graphs that measure the peak (`build_plan`).
pub fn peak_shapes() -> [ConvShape; 2] {
    [
        ConvShape::square(256, 256, 56, 256, 3, 1, 1),
        ConvShape::square(256, 2048, 14, 2048, 1, 0, 1),
    ]
}

/// benches/allreduce.rs: ResNet-50 (3 channels, 1000 classes) at (batch, hw), compiled on the
/// uniform fused route: only its memory plan is used, no layer is planned.
pub fn allreduce_net() -> (NetSpec, usize, usize) {
    (Preset::ResNet50.spec(3, 1000, 64), 1, 224)
}

/// examples/custom_trainer.rs on a GPU: `Preset::Mini.spec(3, CLASSES, 8)` at `BATCH`, `HW`
/// (its constants; tests/planned_gpu_shapes.rs checks they still read so), planned with
/// fallbacks.
pub const CUSTOM_TRAINER: MiniNet = MiniNet {
    channels: 3,
    classes: 4,
    width: 8,
    batch: 16,
    hw: 16,
};

/// crates/6-trainer/tests/gpu_train.rs: the batch of its one configuration (the rest is
/// `TrainConfig::default()`, which is also what `train_cbr --device cuda` runs by default).
pub const GPU_TRAIN_BATCH: usize = 16;

/// A mini network as an example or trainer configures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MiniNet {
    /// Input channels.
    pub channels: usize,
    /// Classes of the head.
    pub classes: usize,
    /// Base channel width.
    pub width: usize,
    /// Images per step.
    pub batch: usize,
    /// Input height = width.
    pub hw: usize,
}

impl MiniNet {
    /// Its description.
    pub fn spec(&self) -> NetSpec {
        Preset::Mini.spec(self.channels, self.classes, self.width)
    }
}
