//! Shapes and hyper-parameters: [`Nhwc`], [`ConvParams`], [`BnParams`], and their validation.
//!
//! Layouts (all contiguous): activations NHWC `[N, H, W, C]`; filters KRSC `[K, R, S, C]`;
//! per-channel vectors `[C]`. A conv maps an input `[N, H, W, C]` to an output `[N, P, Q, K]`
//! with `P = out_h()`, `Q = out_w()`.

use super::error::{ReferenceError, Result};

/// The shape of an NHWC activation tensor (contiguous, channels fastest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Nhwc {
    /// Batch size.
    pub n: usize,
    /// Height.
    pub h: usize,
    /// Width.
    pub w: usize,
    /// Channels.
    pub c: usize,
}

impl Nhwc {
    /// A shape from its four dimensions.
    pub const fn new(n: usize, h: usize, w: usize, c: usize) -> Self {
        Nhwc { n, h, w, c }
    }

    /// `[N, H, W, C]`.
    pub const fn dims(&self) -> [usize; 4] {
        [self.n, self.h, self.w, self.c]
    }

    /// `N * H * W`: the number of pixels, i.e. the element count per channel that batch norm
    /// reduces over (cuDNN's BN-finalize `accum_count`). Saturates instead of overflowing.
    pub fn pixels(&self) -> usize {
        self.n.saturating_mul(self.h).saturating_mul(self.w)
    }

    /// `N * H * W * C`. Saturates instead of overflowing ([`Nhwc::validate`] rejects such shapes).
    pub fn elems(&self) -> usize {
        self.pixels().saturating_mul(self.c)
    }

    /// Checks that every dimension is positive and that the element count fits in `usize`.
    /// `tensor` names the tensor in the error.
    pub fn validate(&self, tensor: &'static str) -> Result<()> {
        for (dim, value) in [("n", self.n), ("h", self.h), ("w", self.w), ("c", self.c)] {
            if value == 0 {
                return Err(ReferenceError::ZeroDimension { tensor, dim });
            }
        }
        checked_product(tensor, &self.dims()).map(|_| ())
    }
}

/// A 2-D convolution (cross-correlation, as cuDNN's `CUDNN_CROSS_CORRELATION`) with symmetric
/// padding: input `x` NHWC `[n, h, w, c]`, filter `w` KRSC `[k, r, s, c]`, output NHWC
/// `[n, out_h, out_w, k]`.
///
/// ```text
/// y[n, p, q, k] = sum over r, s, c of
///     x[n, p*stride_h - pad_h + r*dil_h, q*stride_w - pad_w + s*dil_w, c] * w[k, r, s, c]
/// ```
/// where `x` is zero outside the input. The fields are public; every op calls
/// [`ConvParams::validate`] before it uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvParams {
    /// Batch size.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels (filters).
    pub k: usize,
    /// Filter height.
    pub r: usize,
    /// Filter width.
    pub s: usize,
    /// Zero padding added above and below.
    pub pad_h: usize,
    /// Zero padding added left and right.
    pub pad_w: usize,
    /// Vertical stride.
    pub stride_h: usize,
    /// Horizontal stride.
    pub stride_w: usize,
    /// Vertical dilation.
    pub dil_h: usize,
    /// Horizontal dilation.
    pub dil_w: usize,
}

impl ConvParams {
    /// A conv with no padding, stride 1 and dilation 1; add those with the `with_*` methods.
    pub const fn new(n: usize, c: usize, h: usize, w: usize, k: usize, r: usize, s: usize) -> Self {
        ConvParams {
            n,
            c,
            h,
            w,
            k,
            r,
            s,
            pad_h: 0,
            pad_w: 0,
            stride_h: 1,
            stride_w: 1,
            dil_h: 1,
            dil_w: 1,
        }
    }

    /// The same conv with the given padding.
    pub const fn with_padding(mut self, pad_h: usize, pad_w: usize) -> Self {
        self.pad_h = pad_h;
        self.pad_w = pad_w;
        self
    }

    /// The same conv with the given strides.
    pub const fn with_stride(mut self, stride_h: usize, stride_w: usize) -> Self {
        self.stride_h = stride_h;
        self.stride_w = stride_w;
        self
    }

    /// The same conv with the given dilations.
    pub const fn with_dilation(mut self, dil_h: usize, dil_w: usize) -> Self {
        self.dil_h = dil_h;
        self.dil_w = dil_w;
        self
    }

    /// Output height `P = (h + 2*pad_h - dil_h*(r-1) - 1) / stride_h + 1`, or 0 where the
    /// dilated filter does not fit in the padded input (or a stride is 0).
    pub fn out_h(&self) -> usize {
        out_extent(self.h, self.pad_h, self.r, self.dil_h, self.stride_h)
    }

    /// Output width `Q = (w + 2*pad_w - dil_w*(s-1) - 1) / stride_w + 1`, or 0 where the
    /// dilated filter does not fit in the padded input (or a stride is 0).
    pub fn out_w(&self) -> usize {
        out_extent(self.w, self.pad_w, self.s, self.dil_w, self.stride_w)
    }

    /// The input's shape `[n, h, w, c]`.
    pub const fn input_shape(&self) -> Nhwc {
        Nhwc::new(self.n, self.h, self.w, self.c)
    }

    /// The output's shape `[n, out_h, out_w, k]`.
    pub fn output_shape(&self) -> Nhwc {
        Nhwc::new(self.n, self.out_h(), self.out_w(), self.k)
    }

    /// Elements of the input `x` (`n*h*w*c`).
    pub fn x_elems(&self) -> usize {
        self.input_shape().elems()
    }

    /// Elements of the filter `w` (`k*r*s*c`).
    pub fn w_elems(&self) -> usize {
        self.k
            .saturating_mul(self.r)
            .saturating_mul(self.s)
            .saturating_mul(self.c)
    }

    /// Elements of the output `y` (`n*out_h*out_w*k`).
    pub fn y_elems(&self) -> usize {
        self.output_shape().elems()
    }

    /// Checks that every dimension, stride and dilation is positive, that the output is not
    /// empty and that no element count overflows `usize`. The error names the tensor the
    /// offending dimension belongs to (`x`, `w`, or `conv` for strides and dilations).
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("x", "n", self.n),
            ("x", "c", self.c),
            ("x", "h", self.h),
            ("x", "w", self.w),
            ("w", "k", self.k),
            ("w", "r", self.r),
            ("w", "s", self.s),
            ("conv", "stride_h", self.stride_h),
            ("conv", "stride_w", self.stride_w),
            ("conv", "dil_h", self.dil_h),
            ("conv", "dil_w", self.dil_w),
        ];
        for (tensor, dim, value) in dims {
            if value == 0 {
                return Err(ReferenceError::ZeroDimension { tensor, dim });
            }
        }
        for (axis, extent, pad, filter, dil) in [
            ("out_h", self.h, self.pad_h, self.r, self.dil_h),
            ("out_w", self.w, self.pad_w, self.s, self.dil_w),
        ] {
            let padded = pad
                .checked_mul(2)
                .and_then(|p| p.checked_add(extent))
                .ok_or(ReferenceError::TooLarge { tensor: "x" })?;
            let span =
                dilated_extent(filter, dil).ok_or(ReferenceError::TooLarge { tensor: "w" })?;
            if padded < span {
                return Err(ReferenceError::EmptyOutput {
                    axis,
                    padded,
                    filter: span,
                });
            }
        }
        checked_product("x", &self.input_shape().dims())?;
        checked_product("w", &[self.k, self.r, self.s, self.c])?;
        checked_product("y", &self.output_shape().dims())?;
        // The im2col matrices are `rows x (r*s*c)` and `rows x (r*s*k)` tiles.
        checked_product("w", &[self.r, self.s, self.c.max(self.k)])?;
        Ok(())
    }
}

/// Batch-norm hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BnParams {
    /// Added to the batch variance before the inverse square root. Must be finite and > 0.
    pub epsilon: f64,
    /// Weight of the NEW batch statistic in the running averages (PyTorch's `momentum`, cuDNN's
    /// `exponentialAverageFactor`): `running = (1 - momentum) * running + momentum * batch`.
    /// Must lie in `[0, 1]`.
    pub momentum: f64,
}

impl Default for BnParams {
    /// PyTorch's defaults: `epsilon = 1e-5`, `momentum = 0.1`.
    fn default() -> Self {
        BnParams {
            epsilon: 1e-5,
            momentum: 0.1,
        }
    }
}

impl BnParams {
    /// Checks `epsilon` (finite, > 0) and `momentum` (in `[0, 1]`).
    pub fn validate(&self) -> Result<()> {
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(ReferenceError::InvalidBnParam {
                param: "epsilon",
                value: self.epsilon,
                expected: "a finite value > 0",
            });
        }
        if !(0.0..=1.0).contains(&self.momentum) {
            return Err(ReferenceError::InvalidBnParam {
                param: "momentum",
                value: self.momentum,
                expected: "a value in [0, 1]",
            });
        }
        Ok(())
    }
}

/// Checks that `data` holds exactly `expected` elements.
/// `out` sized to `len` (its old contents left for `fill` to overwrite) and filled by `fill`:
/// an op's vector form over its slice form.
pub(crate) fn filled_vec<T: Default + Clone>(
    mut out: Vec<T>,
    len: usize,
    fill: impl FnOnce(&mut [T]) -> Result<()>,
) -> Result<Vec<T>> {
    out.resize(len, T::default());
    fill(&mut out)?;
    Ok(out)
}

pub(crate) fn check_len<T>(tensor: &'static str, data: &[T], expected: usize) -> Result<()> {
    if data.len() == expected {
        Ok(())
    } else {
        Err(ReferenceError::ShapeMismatch {
            tensor,
            expected,
            got: data.len(),
        })
    }
}

/// Checks that two shapes are equal (the test-only layer chain's check).
#[cfg(test)]
pub(crate) fn check_shape(tensor: &'static str, got: Nhwc, expected: Nhwc) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(ReferenceError::IncompatibleShapes {
            tensor,
            expected: expected.dims(),
            got: got.dims(),
        })
    }
}

fn checked_product(tensor: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(ReferenceError::TooLarge { tensor })
}

/// `dil * (filter - 1) + 1`, the extent a dilated filter covers.
fn dilated_extent(filter: usize, dil: usize) -> Option<usize> {
    filter.checked_sub(1)?.checked_mul(dil)?.checked_add(1)
}

fn out_extent(extent: usize, pad: usize, filter: usize, dil: usize, stride: usize) -> usize {
    let padded = extent.saturating_add(pad.saturating_mul(2));
    match dilated_extent(filter, dil) {
        Some(span) if stride > 0 && padded >= span => (padded - span) / stride + 1,
        _ => 0,
    }
}
