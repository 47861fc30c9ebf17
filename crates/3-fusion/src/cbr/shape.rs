//! The geometry of one CBR layer.

/// One conv layer's shape: NHWC activations, KRSC filter, square padding and stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvShape {
    /// Batch.
    pub n: i64,
    /// Input channels.
    pub c: i64,
    /// Input height.
    pub h: i64,
    /// Input width.
    pub w: i64,
    /// Output channels.
    pub k: i64,
    /// Filter height.
    pub r: i64,
    /// Filter width.
    pub s: i64,
    /// Padding (both sides, both dims).
    pub pad: i64,
    /// Stride (both dims).
    pub stride: i64,
}

impl ConvShape {
    /// The largest tensor, in bytes, a layer or network may hold: 2^47, the user address
    /// space of x86-64 and AArch64 with 4-level page tables. A larger buffer cannot be
    /// allocated on any host or GPU, so shapes beyond it are refused before any size is
    /// computed from them.
    pub const MAX_TENSOR_BYTES: i64 = 1 << 47;

    /// The project's reference layer: N=32, C=K=64, 56×56, 3×3, pad 1, stride 1.
    pub const RESNET_3X3: ConvShape = ConvShape {
        n: 32,
        c: 64,
        h: 56,
        w: 56,
        k: 64,
        r: 3,
        s: 3,
        pad: 1,
        stride: 1,
    };

    /// A square layer: `n`×`c`×`hw`×`hw` in, `k` filters of `rs`×`rs`.
    pub fn square(n: i64, c: i64, hw: i64, k: i64, rs: i64, pad: i64, stride: i64) -> Self {
        ConvShape {
            n,
            c,
            h: hw,
            w: hw,
            k,
            r: rs,
            s: rs,
            pad,
            stride,
        }
    }

    /// Checks the shape before any arithmetic on it: every extent ≥ 1, padding ≥ 0, stride ≥ 1,
    /// the filter fits the padded input, and every tensor's element count fits in memory
    /// arithmetic (checked, no wrap-around). The error names the field and its value.
    pub fn validate(&self) -> crate::error::Result<()> {
        let bad = |field: &str, problem: String| {
            Err(crate::error::Error::InvalidConfig {
                layer: "conv shape".into(),
                field: field.into(),
                problem,
            })
        };
        for (field, v) in [
            ("n", self.n),
            ("c", self.c),
            ("h", self.h),
            ("w", self.w),
            ("k", self.k),
            ("r", self.r),
            ("s", self.s),
            ("stride", self.stride),
        ] {
            if v < 1 {
                return bad(field, format!("must be >= 1, got {v}"));
            }
        }
        if self.pad < 0 {
            return bad("pad", format!("must be >= 0, got {}", self.pad));
        }
        let padded = |x: i64| x.checked_add(self.pad.checked_mul(2)?);
        match (padded(self.h), padded(self.w)) {
            (Some(h), Some(w)) if h >= self.r && w >= self.s => {}
            (Some(_), Some(_)) => {
                return bad(
                    "r/s",
                    format!(
                        "filter {}x{} is larger than the padded input {}x{} (pad {})",
                        self.r, self.s, self.h, self.w, self.pad
                    ),
                )
            }
            _ => return bad("pad", format!("{} overflows the input size", self.pad)),
        }
        // Element counts of x, w and y must not wrap, and each tensor (in FP32, the widest
        // copy any executor makes) must fit a process's address space.
        let max = Self::MAX_TENSOR_BYTES / 4;
        let product = |dims: [i64; 4]| {
            dims.iter()
                .try_fold(1i64, |acc, &d| acc.checked_mul(d))
                .filter(|&e| e <= max)
        };
        for (field, dims) in [
            ("x", self.x_dims()),
            ("w", self.w_dims()),
            ("y", self.y_dims()),
        ] {
            if product(dims).is_none() {
                return bad(
                    field,
                    format!(
                        "has {dims:?} elements: beyond {max} (no buffer of more than \
                         {} bytes can be allocated)",
                        Self::MAX_TENSOR_BYTES
                    ),
                );
            }
        }
        Ok(())
    }

    /// Output height.
    pub fn p(&self) -> i64 {
        (self.h + 2 * self.pad - self.r) / self.stride + 1
    }

    /// Output width.
    pub fn q(&self) -> i64 {
        (self.w + 2 * self.pad - self.s) / self.stride + 1
    }

    /// Input dims `[N, C, H, W]`.
    pub fn x_dims(&self) -> [i64; 4] {
        [self.n, self.c, self.h, self.w]
    }

    /// Filter dims `[K, C, R, S]`.
    pub fn w_dims(&self) -> [i64; 4] {
        [self.k, self.c, self.r, self.s]
    }

    /// Output dims `[N, K, P, Q]`.
    pub fn y_dims(&self) -> [i64; 4] {
        [self.n, self.k, self.p(), self.q()]
    }

    /// Elements per output channel (N·P·Q): BN's count.
    pub fn count(&self) -> i64 {
        self.n * self.p() * self.q()
    }

    /// Forward FLOPs of the convolution (2·N·K·P·Q·C·R·S).
    pub fn flops(&self) -> f64 {
        2.0 * (self.n * self.k * self.p() * self.q() * self.c * self.r * self.s) as f64
    }

    /// The conv attributes for the graph layer.
    pub fn conv_attrs(&self) -> crate::graph::ConvAttrs {
        crate::graph::ConvAttrs::default()
            .padding(self.pad)
            .stride(self.stride)
    }

    /// The CPU reference executor's parameters for this geometry.
    pub fn reference_params(&self) -> crate::reference::ConvParams {
        crate::reference::ConvParams::new(
            self.n as usize,
            self.c as usize,
            self.h as usize,
            self.w as usize,
            self.k as usize,
            self.r as usize,
            self.s as usize,
        )
        .with_padding(self.pad as usize, self.pad as usize)
        .with_stride(self.stride as usize, self.stride as usize)
    }

    /// A short label like `n32 c64 56x56 k64 3x3 s1`.
    pub fn label(&self) -> String {
        format!(
            "n{} c{} {}x{} k{} {}x{} s{}",
            self.n, self.c, self.h, self.w, self.k, self.r, self.s, self.stride
        )
    }
}
