//! [`Backend`] for [`CudaBackend`]: the network's passes on the caller's image buffer (read in
//! place) with the parameters in the amp regions, the head's passes on amp's kernels (steps
//! 2–6 of the module table), the evaluation logits and the running statistics.

use super::{driver, CudaBackend, Result};
use crate::amp::cuda::{CudaRegions, CudaSlice, DevRange, DevRangeMut};
use crate::amp::plan::Region;
use crate::classifier::backend::{Backend, BucketReduce};
use crate::classifier::{ClassifierError, EvalWeights};
use crate::fusion::cbr::Pass;
#[cfg(doc)]
use crate::net::CudaNet;
use crate::net::{CompiledNet, CudaNetError, CudaNetPass, GradSchedule};
use crate::netops::cuda::RegionsFc;
use half::f16;

impl Backend for CudaBackend {
    type Regions = CudaRegions;
    type Exec<'a> = CudaNetPass<'a>;
    type NetError = CudaNetError;
    type Images<'a> = &'a mut CudaSlice<f16>;
    // Loss and accuracy stay on the device (the metrics log, or `metrics_blocking`).
    type Metrics = ();

    fn compiled(&self) -> &CompiledNet {
        self.net.compiled()
    }

    fn images_len(images: &&mut CudaSlice<f16>) -> usize {
        images.len()
    }

    fn reborrow<'s>(images: &'s mut &mut CudaSlice<f16>) -> &'s mut CudaSlice<f16> {
        images
    }

    fn write_master(regions: &mut CudaRegions, name: &str, values: &[f32]) -> Result<()> {
        Ok(regions.upload_f32(Region::W, name, values)?)
    }

    fn region_bytes(regions: &CudaRegions, region: Region) -> Result<Vec<u8>> {
        Ok(regions.download_region_bytes(region)?)
    }

    fn load_region_bytes(regions: &mut CudaRegions, region: Region, bytes: &[u8]) -> Result<()> {
        Ok(regions.upload_region_bytes(region, bytes)?)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize the stream", e))
    }

    fn load_labels(&mut self, labels: &[i32]) -> Result<()> {
        let bytes: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
        self.stream
            .memcpy_htod(&bytes, &mut self.head.labels)
            .map_err(|e| driver("copy the labels in", e))?;
        self.head.host_labels = labels.to_vec();
        Ok(())
    }

    /// The pass binds the regions' parameters and reads `images` in place; the EMA weights are
    /// swapped in by [`Backend::eval_logits`] around its pass, so a pass itself reads the
    /// trained slots.
    fn begin_pass<'a>(
        &'a mut self,
        regions: &'a mut CudaRegions,
        images: &'a mut CudaSlice<f16>,
        _pass: Pass,
        weights: EvalWeights,
    ) -> Result<CudaNetPass<'a>> {
        if weights == EvalWeights::Ema {
            return Err(ClassifierError::Input(
                "a CUDA network pass reads the trained slots: evaluate with the EMA through \
                 eval_logits, which swaps the EMA weights in"
                    .into(),
            ));
        }
        Ok(self.net.pass_on(regions, images)?)
    }

    fn end_pass(&mut self, regions: &mut CudaRegions, _pass: Pass) -> Result<()> {
        Ok(self.net.after_pass(regions)?)
    }

    /// [`CudaNet::backward_overlapped`] on the caller's images: `reduce` enqueues each
    /// bucket's sum (on a stream of its own, ordered after the compute stream's work so far:
    /// [`crate::dist::NcclStepSync`]) while the shallower layers' backward is enqueued.
    fn backward_reduced(
        &mut self,
        regions: &mut CudaRegions,
        images: &mut CudaSlice<f16>,
        schedule: &GradSchedule,
        reduce: &mut BucketReduce<'_, CudaRegions>,
    ) -> Result<()> {
        // The first failure of `reduce`, kept while the pass stops.
        let mut failed: Option<ClassifierError> = None;
        let pass = self.net.backward_overlapped(
            regions,
            Some(images),
            schedule,
            &mut |regions, bucket, _| {
                reduce(regions, bucket).map_err(|e| {
                    failed = Some(e);
                    CudaNetError::Binding("a gradient bucket's all-reduce failed".into())
                })
            },
        );
        match (failed, pass) {
            (Some(e), _) => Err(e),
            (None, pass) => Ok(pass?),
        }
    }

    /// Pooling and FC of the network's output into the logits (step 3).
    fn head_forward(&mut self, regions: &mut CudaRegions) -> Result<()> {
        let shape = self.head.shape;
        let a = self.net.buffer(self.net.compiled().output)?;
        self.net_kernels.gap_forward(
            &self.stream,
            &shape,
            DevRange::whole(a),
            DevRangeMut::whole(&mut self.head.pooled),
        )?;
        Ok(regions.fc_forward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&self.head.pooled),
            DevRangeMut::whole(&mut self.head.logits),
        )?)
    }

    /// Loss seed, metrics (with a log), FC and pooling backward into the network output's
    /// gradient (steps 4–5).
    fn head_backward(&mut self, regions: &mut CudaRegions) -> Result<()> {
        let shape = self.head.shape;
        let h = &mut self.head;
        self.kernels.softmax_xent_backward_range(
            &self.stream,
            shape.classes,
            DevRange::whole(&h.logits),
            DevRange::whole(&h.labels),
            DevRange::whole(regions.region(Region::S)?),
            DevRangeMut::whole(&mut h.dlogits),
            Some(DevRangeMut::whole(&mut h.loss)),
        )?;
        if let Some(log) = h.log.as_mut() {
            self.net_kernels.head_metrics(
                &self.stream,
                shape.classes,
                DevRange::whole(&h.logits),
                DevRange::whole(&h.labels),
                Some(DevRange::whole(&h.loss)),
                DevRangeMut::whole(log),
            )?;
        }
        regions.fc_backward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&h.dlogits),
            DevRange::whole(&h.pooled),
            DevRangeMut::whole(&mut h.dpooled),
        )?;
        let d_out = self.net.compiled().output_grad;
        let d_out = self.net.buffer_mut(d_out)?;
        Ok(self.net_kernels.gap_backward(
            &self.stream,
            &shape,
            DevRange::whole(&h.dpooled),
            DevRangeMut::whole(d_out),
        )?)
    }

    /// The evaluation pass ([`Backend::network_pass`]), then the pooling and the FC layer into logits of their own
    /// (so that the last training batch's metrics stay readable), read back; the EMA weights
    /// swapped in for it and the trained ones always restored.
    fn eval_logits(
        &mut self,
        regions: &mut CudaRegions,
        images: &mut CudaSlice<f16>,
        weights: EvalWeights,
    ) -> Result<Vec<f16>> {
        if weights == EvalWeights::Ema {
            let aside = regions.swap_in_ema()?;
            let out = self.eval_logits(regions, images, EvalWeights::Trained);
            // Always restored, so that a failed evaluation leaves the trained weights.
            regions.swap_back(aside)?;
            return out;
        }
        let shape = self.head.shape;
        self.network_pass(regions, images, Pass::Eval, EvalWeights::Trained)?;
        let output = self.net.compiled().output;
        let mut logits = self
            .stream
            .alloc_zeros::<u8>(shape.batch * shape.classes * 2)
            .map_err(|e| driver("allocate the evaluation logits", e))?;
        self.net_kernels.gap_forward(
            &self.stream,
            &shape,
            DevRange::whole(self.net.buffer(output)?),
            DevRangeMut::whole(&mut self.head.pooled),
        )?;
        regions.fc_forward(
            "fc.w",
            "fc.b",
            &shape,
            DevRange::whole(&self.head.pooled),
            DevRangeMut::whole(&mut logits),
        )?;
        Ok(self
            .stream
            .clone_dtoh(&logits)
            .map_err(|e| driver("read the evaluation logits back", e))?
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]))
            .collect())
    }

    /// Downloaded (blocking).
    fn read_running_stat(&self, name: &str) -> Result<Vec<f32>> {
        let bytes = self.net.download(name)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Uploaded in stream order.
    fn write_running_stat(&mut self, name: &str, values: Vec<f32>) -> Result<()> {
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(self.net.upload(name, &bytes)?)
    }
}
