//! Max-pool over NHWC FP16: CPU twins of `crates/4-netops/kernels/net_pool.cu`.
//!
//! | op | definition |
//! |----|------------|
//! | [`max_pool_forward`] | `y[n,i,j,c]` = the first maximum of its window (rows, then columns; padding never wins) |
//! | [`max_pool_backward`] | `dx[n,h,w,c] = f16(Σ dy[n,i,j,c])` over the windows `(i, j)` (ascending) whose choice is `(h, w)`, summed in f32 |
//!
//! Both executors agree bit for bit: the same choice rule, the same summation order.

#![forbid(unsafe_code)]

use cudnn_cbr_amp::range::{f16_to_f32, f32_to_f16};
use cudnn_cbr_amp::RangeOpError;
use half::f16;

/// A max-pool over `batch` NHWC images of `h`×`w`×`channels`: square `kernel`, `stride`, and
/// `pad` on every side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Images.
    pub batch: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Channels.
    pub channels: usize,
    /// Window size.
    pub kernel: usize,
    /// Stride.
    pub stride: usize,
    /// Padding.
    pub pad: usize,
}

impl PoolShape {
    /// Every extent at least 1, `pad < kernel` (every window holds a real pixel), the window
    /// fits the padded input, and the element counts are representable.
    ///
    /// # Errors
    /// [`RangeOpError::InvalidConfig`] naming the field.
    pub fn validate(&self, op: &'static str) -> Result<(), RangeOpError> {
        let bad = |field: &'static str, value: usize, why: &'static str| {
            Err(RangeOpError::InvalidConfig {
                op,
                field,
                value: value.to_string(),
                why,
            })
        };
        for (field, v) in [
            ("batch", self.batch),
            ("h", self.h),
            ("w", self.w),
            ("channels", self.channels),
            ("kernel", self.kernel),
            ("stride", self.stride),
        ] {
            if v == 0 {
                return bad(field, v, "must be >= 1");
            }
        }
        if self.pad >= self.kernel {
            return bad("pad", self.pad, "must be smaller than the kernel");
        }
        let padded = |x: usize| x.checked_add(self.pad.checked_mul(2)?);
        match (padded(self.h), padded(self.w)) {
            (Some(h), Some(w)) if h >= self.kernel && w >= self.kernel => {}
            _ => return bad("kernel", self.kernel, "must fit the padded input"),
        }
        let fits = self
            .batch
            .checked_mul(self.h)
            .and_then(|v| v.checked_mul(self.w))
            .and_then(|v| v.checked_mul(self.channels))
            .and_then(|v| v.checked_mul(2))
            .is_some();
        if !fits {
            return bad("batch", self.batch, "element counts overflow");
        }
        Ok(())
    }

    /// Output height.
    pub fn out_h(&self) -> usize {
        (self.h + 2 * self.pad - self.kernel) / self.stride + 1
    }

    /// Output width.
    pub fn out_w(&self) -> usize {
        (self.w + 2 * self.pad - self.kernel) / self.stride + 1
    }

    /// Input elements.
    pub fn input_elems(&self) -> usize {
        self.batch * self.h * self.w * self.channels
    }

    /// Output elements.
    pub fn output_elems(&self) -> usize {
        self.batch * self.out_h() * self.out_w() * self.channels
    }

    /// The flat input index of window `(n, i, j, ch)`'s first maximum.
    fn argmax(&self, x: &[f16], n: usize, i: usize, j: usize, ch: usize) -> usize {
        let mut best: Option<(usize, f32)> = None;
        for di in 0..self.kernel {
            let hp = i * self.stride + di;
            if hp < self.pad || hp - self.pad >= self.h {
                continue;
            }
            for dj in 0..self.kernel {
                let wp = j * self.stride + dj;
                if wp < self.pad || wp - self.pad >= self.w {
                    continue;
                }
                let at =
                    ((n * self.h + hp - self.pad) * self.w + wp - self.pad) * self.channels + ch;
                let v = f16_to_f32(x[at]);
                if best.is_none_or(|(_, b)| v > b) {
                    best = Some((at, v));
                }
            }
        }
        // pad < kernel (validated): every window holds a real pixel.
        best.map_or(0, |(at, _)| at)
    }
}

fn check(
    op: &'static str,
    name: &'static str,
    got: usize,
    want: usize,
) -> Result<(), RangeOpError> {
    cudnn_cbr_amp::range::check_len(op, name, want, got)
}

/// `y = maxpool(x)` (see the module table).
///
/// # Errors
/// [`RangeOpError::InvalidConfig`] for a bad shape, [`RangeOpError::LengthMismatch`] for
/// slices of the wrong length.
pub fn max_pool_forward(shape: &PoolShape, x: &[f16], y: &mut [f16]) -> Result<(), RangeOpError> {
    const OP: &str = "max_pool_forward";
    shape.validate(OP)?;
    check(OP, "x", x.len(), shape.input_elems())?;
    check(OP, "y", y.len(), shape.output_elems())?;
    let (oh, ow, c) = (shape.out_h(), shape.out_w(), shape.channels);
    for (o, out) in y.iter_mut().enumerate() {
        let (ch, j, i, n) = (o % c, (o / c) % ow, (o / (c * ow)) % oh, o / (c * ow * oh));
        *out = x[shape.argmax(x, n, i, j, ch)];
    }
    Ok(())
}

/// The max-pool's backward (see the module table): `dy` of the output's shape → `dx` of the
/// input's.
///
/// # Errors
/// As [`max_pool_forward`].
pub fn max_pool_backward(
    shape: &PoolShape,
    x: &[f16],
    dy: &[f16],
    dx: &mut [f16],
) -> Result<(), RangeOpError> {
    const OP: &str = "max_pool_backward";
    shape.validate(OP)?;
    check(OP, "x", x.len(), shape.input_elems())?;
    check(OP, "dy", dy.len(), shape.output_elems())?;
    check(OP, "dx", dx.len(), shape.input_elems())?;
    let (oh, ow, c) = (shape.out_h(), shape.out_w(), shape.channels);
    let mut acc = vec![0f32; x.len()];
    // Output order (n, i, j, ch) ascending: each input element receives its windows'
    // gradients in ascending (i, j), as the kernel's gather sums them.
    for (o, g) in dy.iter().enumerate() {
        let (ch, j, i, n) = (o % c, (o / c) % ow, (o / (c * ow)) % oh, o / (c * ow * oh));
        acc[shape.argmax(x, n, i, j, ch)] += f16_to_f32(*g);
    }
    for (d, a) in dx.iter_mut().zip(acc) {
        *d = f32_to_f16(a);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: &[f32]) -> Vec<f16> {
        v.iter().map(|&x| f16::from_f32(x)).collect()
    }

    const STEM: PoolShape = PoolShape {
        batch: 1,
        h: 3,
        w: 3,
        channels: 1,
        kernel: 3,
        stride: 2,
        pad: 1,
    };

    #[test]
    fn ties_go_to_the_first_maximum_and_overlapping_windows_add_up() {
        // 3×3 input, 3×3/2 pad 1 → 2×2 windows, each overlapping the centre row/column.
        let x = h(&[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let mut y = vec![f16::ZERO; 4];
        max_pool_forward(&STEM, &x, &mut y).unwrap();
        assert!(y.iter().all(|v| v.to_f32() == 0.0));
        // All zero: window (i, j) picks its first real pixel: (0,0), (0,1), (1,0), (1,1).
        let dy = h(&[1.0, 2.0, 4.0, 8.0]);
        let mut dx = vec![f16::ZERO; 9];
        max_pool_backward(&STEM, &x, &dy, &mut dx).unwrap();
        assert_eq!(
            dx.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            [1.0, 2.0, 0.0, 4.0, 8.0, 0.0, 0.0, 0.0, 0.0]
        );
        // One clear maximum in the centre: every window picks it; the gradients add.
        let x = h(&[0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
        max_pool_forward(&STEM, &x, &mut y).unwrap();
        assert!(y.iter().all(|v| v.to_f32() == 5.0));
        max_pool_backward(&STEM, &x, &dy, &mut dx).unwrap();
        assert_eq!(dx[4].to_f32(), 15.0);
        assert_eq!(dx.iter().map(|v| v.to_f32()).sum::<f32>(), 15.0);
    }

    #[test]
    fn bad_shapes_and_lengths_are_typed_errors() {
        let bad = PoolShape { pad: 3, ..STEM };
        let mut y = vec![f16::ZERO; 4];
        assert!(matches!(
            max_pool_forward(&bad, &h(&[0.0; 9]), &mut y),
            Err(RangeOpError::InvalidConfig { field: "pad", .. })
        ));
        let zero = PoolShape { stride: 0, ..STEM };
        assert!(matches!(
            max_pool_forward(&zero, &h(&[0.0; 9]), &mut y),
            Err(RangeOpError::InvalidConfig {
                field: "stride",
                ..
            })
        ));
        assert!(matches!(
            max_pool_forward(&STEM, &h(&[0.0; 8]), &mut y),
            Err(RangeOpError::LengthMismatch { what: "x", .. })
        ));
    }
}
