//! A network description: stem, stages of basic or bottleneck blocks, head; and the presets.
//!
//! The description says *what* the network is (torchvision's ResNet v1.5 family: the stride of
//! a bottleneck stage sits on its 3×3 conv); [`super::compile()`] derives every layer, buffer and
//! step from it.

use std::fmt;
use std::str::FromStr;

/// The stem's optional max-pool (padding never wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolSpec {
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding on every side.
    pub pad: usize,
}

/// The stem: one conv + BN + ReLU (stored), then an optional max-pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StemSpec {
    /// Output channels.
    pub out: usize,
    /// Square kernel size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding.
    pub pad: usize,
    /// Max-pool after the activation.
    pub max_pool: Option<PoolSpec>,
}

/// The kind of a residual block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// Two 3×3 convs (ResNet-18/34); the stride on the first.
    Basic,
    /// 1×1 → 3×3 → 1×1 (ResNet-50/101); the stride on the 3×3.
    Bottleneck,
}

/// One residual block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSpec {
    /// Basic or bottleneck.
    pub kind: BlockKind,
    /// Channels of the block input.
    pub in_ch: usize,
    /// Channels of the inner convs (a bottleneck's 1×1 → 3×3 width; a basic block's first conv).
    pub width: usize,
    /// Channels of the block output.
    pub out: usize,
    /// Stride of the block (on conv1 of a basic block, conv2 of a bottleneck, and the
    /// projection).
    pub stride: usize,
    /// A projection shortcut `bn(conv1×1/stride(x))`; identity when false (which needs
    /// `in_ch == out` and stride 1).
    pub projection: bool,
}

impl BlockSpec {
    /// A block whose shortcut is a projection exactly when the shape changes.
    pub fn new(kind: BlockKind, in_ch: usize, width: usize, out: usize, stride: usize) -> Self {
        BlockSpec {
            kind,
            in_ch,
            width,
            out,
            stride,
            projection: in_ch != out || stride != 1,
        }
    }
}

/// A whole network: input, stem, stages (each a list of blocks), classes of the FC head.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetSpec {
    /// The preset's or the user's name for it.
    pub name: String,
    /// Input channels.
    pub in_channels: usize,
    /// The stem.
    pub stem: StemSpec,
    /// Stages of blocks, in order.
    pub stages: Vec<Vec<BlockSpec>>,
    /// Classes of the FC head (after a global average pool).
    pub classes: usize,
}

/// The presets `train_cbr --net` and `deviceless_plans --net` accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Preset {
    /// The main job's small network: a 3×3 stem without pooling, one basic block of `width`
    /// channels, one basic block of `2·width` with stride 2 and a projection shortcut.
    #[default]
    Mini,
    /// ResNet-18: basic blocks [2, 2, 2, 2].
    ResNet18,
    /// ResNet-34: basic blocks [3, 4, 6, 3].
    ResNet34,
    /// ResNet-50: bottleneck blocks [3, 4, 6, 3].
    ResNet50,
    /// ResNet-101: bottleneck blocks [3, 4, 23, 3].
    ResNet101,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 5] = [
        Preset::Mini,
        Preset::ResNet18,
        Preset::ResNet34,
        Preset::ResNet50,
        Preset::ResNet101,
    ];

    /// `mini`, `resnet18`, …
    pub fn name(self) -> &'static str {
        match self {
            Preset::Mini => "mini",
            Preset::ResNet18 => "resnet18",
            Preset::ResNet34 => "resnet34",
            Preset::ResNet50 => "resnet50",
            Preset::ResNet101 => "resnet101",
        }
    }

    /// The network for `in_channels` input channels and `classes` classes. `width` is the
    /// mini network's base width (the ResNets ignore it: their widths are fixed).
    pub fn spec(self, in_channels: usize, classes: usize, width: usize) -> NetSpec {
        match self {
            Preset::Mini => mini(in_channels, classes, width),
            Preset::ResNet18 => resnet(self, BlockKind::Basic, [2, 2, 2, 2], in_channels, classes),
            Preset::ResNet34 => resnet(self, BlockKind::Basic, [3, 4, 6, 3], in_channels, classes),
            Preset::ResNet50 => resnet(
                self,
                BlockKind::Bottleneck,
                [3, 4, 6, 3],
                in_channels,
                classes,
            ),
            Preset::ResNet101 => resnet(
                self,
                BlockKind::Bottleneck,
                [3, 4, 23, 3],
                in_channels,
                classes,
            ),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
                format!("network must be one of {}, got `{s}`", names.join(", "))
            })
    }
}

fn mini(in_channels: usize, classes: usize, width: usize) -> NetSpec {
    let w = width;
    NetSpec {
        name: "mini".into(),
        in_channels,
        stem: StemSpec {
            out: w,
            kernel: 3,
            stride: 1,
            pad: 1,
            max_pool: None,
        },
        stages: vec![
            vec![BlockSpec::new(BlockKind::Basic, w, w, w, 1)],
            vec![BlockSpec::new(BlockKind::Basic, w, 2 * w, 2 * w, 2)],
        ],
        classes,
    }
}

/// torchvision's ResNet v1.5: 7×7/2 stem with a 3×3/2 max-pool, stages of 64·2^i width, the
/// stage stride (2 from the second stage on) in its first block.
fn resnet(
    preset: Preset,
    kind: BlockKind,
    blocks: [usize; 4],
    in_channels: usize,
    classes: usize,
) -> NetSpec {
    let expansion = match kind {
        BlockKind::Basic => 1,
        BlockKind::Bottleneck => 4,
    };
    let mut in_ch = 64;
    let stages = blocks
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let width = 64 << i;
            let out = width * expansion;
            (0..n)
                .map(|j| {
                    let stride = if i > 0 && j == 0 { 2 } else { 1 };
                    let b = BlockSpec::new(kind, in_ch, width, out, stride);
                    in_ch = out;
                    b
                })
                .collect()
        })
        .collect();
    NetSpec {
        name: preset.name().into(),
        in_channels,
        stem: StemSpec {
            out: 64,
            kernel: 7,
            stride: 2,
            pad: 3,
            max_pool: Some(PoolSpec {
                kernel: 3,
                stride: 2,
                pad: 1,
            }),
        },
        stages,
        classes,
    }
}
