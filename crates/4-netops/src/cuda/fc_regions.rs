//! [`RegionsFc`]: the FC layer with its parameters in amp's regions (weights read from W,
//! gradients written into G), on [`CudaRegions`].

use cudnn_cbr_amp::cuda::{CudaRegions, DevRange, DevRangeMut};
use cudnn_cbr_amp::plan::Region;
use cudnn_cbr_amp::{AmpError, ExecError, RangeOpError};
use cudnn_cbr_runtime::DataType;

use crate::cuda::head::FcParams;
use crate::cuda::NetKernels;
use crate::head::HeadShape;

/// The FC layer of the head with its parameters in a plan's regions: implemented for
/// [`CudaRegions`], enqueued on [`CudaRegions::stream`] with the network's kernels of its
/// context ([`NetKernels::for_context`]).
pub trait RegionsFc {
    /// The FC layer's forward with its parameters in this plan (twin:
    /// [`crate::head::fc_forward`]): FP32 weight `weight` `[classes, features]` and bias
    /// `bias` `[classes]` read from W (the master weights), FP32 `x` `[batch, features]` →
    /// FP16 `logits` `[batch, classes]`.
    ///
    /// # Errors
    /// Plan lookup errors, [`RangeOpError::LengthMismatch`] when a parameter does not have
    /// the shape's element count, [`ExecError::WrongRegion`] for a parameter that is not
    /// FP32; as [`NetKernels::fc_forward`].
    fn fc_forward(
        &self,
        weight: &str,
        bias: &str,
        shape: &HeadShape,
        x: DevRange<'_>,
        logits: DevRangeMut<'_>,
    ) -> Result<(), AmpError>;

    /// The FC layer's backward with its parameters in this plan (twin:
    /// [`crate::head::fc_backward`]): reads the FP32 weight `weight` from W, writes the FP32
    /// gradients of `weight` and `bias` into their G slots (overwriting; G holds scaled
    /// gradients like every other slot, since `dlogits` carries the loss scale), and the
    /// pooled features' FP32 gradient into `dx`.
    ///
    /// # Errors
    /// Plan lookup errors, [`RangeOpError::InvalidConfig`] when `weight` and `bias` name the
    /// same parameter, [`RangeOpError::LengthMismatch`] when a parameter does not have the
    /// shape's element count; as [`NetKernels::fc_backward`].
    fn fc_backward(
        &mut self,
        weight: &str,
        bias: &str,
        shape: &HeadShape,
        dlogits: DevRange<'_>,
        x: DevRange<'_>,
        dx: DevRangeMut<'_>,
    ) -> Result<(), AmpError>;
}

/// Device address of FP32 parameter `name` in `region`, checked to hold `elems` elements.
fn f32_param_addr(
    regions: &CudaRegions,
    op: &'static str,
    name: &str,
    region: Region,
    elems: usize,
) -> Result<u64, AmpError> {
    let v = regions.plan_arc().view(name, region)?;
    if v.dtype != DataType::Float {
        return Err(ExecError::WrongRegion {
            op,
            region,
            role: "typed transfer",
            needs: "an FP32 region (W, G, M, E)",
        }
        .into());
    }
    if v.elems != elems {
        return Err(RangeOpError::LengthMismatch {
            op,
            what: "FC parameter",
            expected: elems,
            got: v.elems,
        }
        .into());
    }
    regions.param_addr(name, region)
}

impl RegionsFc for CudaRegions {
    fn fc_forward(
        &self,
        weight: &str,
        bias: &str,
        shape: &HeadShape,
        x: DevRange<'_>,
        logits: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = "fc_forward";
        shape.validate(OP)?;
        let w = self.plan_arc().view(weight, Region::W)?.data_range();
        let b = self.plan_arc().view(bias, Region::W)?.data_range();
        // Element counts and types are checked by the launch against the shape.
        f32_param_addr(self, OP, weight, Region::W, shape.weight_elems())?;
        f32_param_addr(self, OP, bias, Region::W, shape.classes)?;
        let kernels = NetKernels::for_context(self.stream().context())?;
        let buf = self.region(Region::W)?;
        kernels.fc_forward(
            self.stream(),
            shape,
            x,
            DevRange::new(buf, w)?,
            DevRange::new(buf, b)?,
            logits,
        )
    }

    fn fc_backward(
        &mut self,
        weight: &str,
        bias: &str,
        shape: &HeadShape,
        dlogits: DevRange<'_>,
        x: DevRange<'_>,
        dx: DevRangeMut<'_>,
    ) -> Result<(), AmpError> {
        const OP: &str = "fc_backward";
        shape.validate(OP)?;
        if weight == bias {
            return Err(RangeOpError::InvalidConfig {
                op: OP,
                field: "bias",
                value: bias.to_owned(),
                why: "must be another parameter than the weight",
            }
            .into());
        }
        let params = FcParams {
            w: f32_param_addr(self, OP, weight, Region::W, shape.weight_elems())?,
            dw: f32_param_addr(self, OP, weight, Region::G, shape.weight_elems())?,
            db: f32_param_addr(self, OP, bias, Region::G, shape.classes)?,
        };
        let kernels = NetKernels::for_context(self.stream().context())?;
        // The three addresses are slots of regions W and G, which these regions own and free
        // on their stream after enqueued work; each holds the shape's element count of f32
        // (checked just above); the dw and db slots belong to two different parameters, so
        // they overlap neither each other nor W (another allocation).
        // SAFETY: as above; `dlogits`, `x` and `dx` cannot be views of these regions because
        // `self` is borrowed mutably for the call.
        unsafe { kernels.fc_backward_with(self.stream(), shape, dlogits, x, dx, params) }
    }
}
