//! The engine's state in and out (blocking, for tests and checkpoints): a [`Snapshot`] of
//! everything a step reads and writes that outlives it, and the restore of a checkpoint's
//! regions and running statistics.

use super::{driver, CudaClassifier, Result, Snapshot};
use crate::amp::plan::Region;
use crate::amp::range::Scalars;
use crate::amp::AmpError;
use crate::net::cuda::running_stats;

impl CudaClassifier {
    /// Downloads every region the plan has, each layer's running statistics and the metrics
    /// log (empty without one); blocking.
    ///
    /// # Errors
    /// A driver error.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let regions = self.step.executor();
        let mut out = Snapshot {
            regions: Vec::new(),
            running: Vec::new(),
            log: Vec::new(),
        };
        for r in Region::ALL {
            if regions.plan_arc().has_region(r) {
                out.regions.push((r, regions.download_region_bytes(r)?));
            }
        }
        out.running = self.running_stats()?;
        if let Some(log) = &self.head.log {
            out.log = self
                .stream
                .clone_dtoh(log)
                .map_err(|e| driver("download the metrics log", e))?;
        }
        Ok(out)
    }

    /// (buffer, values) for every layer's `running_mean` and `running_var`, downloaded
    /// (blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn running_stats(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let net = self.net.compiled();
        let mut out = Vec::new();
        for id in running_stats(net) {
            let name = &net.buffers[id].name;
            let bytes = self.net.download(name)?;
            let v = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            out.push((name.clone(), v));
        }
        Ok(out)
    }

    /// Writes a [`Snapshot`] back (asynchronously, in stream order).
    ///
    /// # Errors
    /// A snapshot of another configuration; a driver error.
    pub fn restore(&mut self, s: &Snapshot) -> Result<()> {
        for (r, bytes) in &s.regions {
            self.step.executor_mut().upload_region_bytes(*r, bytes)?;
        }
        self.set_running_stats(&s.running)?;
        if let Some(log) = self.head.log.as_mut() {
            self.stream
                .memcpy_htod(&s.log, log)
                .map_err(|e| driver("restore the metrics log", e))?;
        }
        Ok(())
    }

    /// Uploads running statistics by buffer name (in stream order).
    fn set_running_stats(&mut self, running: &[(String, Vec<f32>)]) -> Result<()> {
        for (name, v) in running {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.net.upload(name, &bytes)?;
        }
        Ok(())
    }

    /// Restores a checkpoint's state and waits for it: `regions` in order (W, then A and the
    /// EMA made from it; S through [`crate::amp::step::AmpStep::restore_scalars`], with this
    /// step's SGD values; any other region as it is), then the running statistics.
    ///
    /// # Errors
    /// A state of another network; a driver error.
    pub fn load_state(
        &mut self,
        regions: &[(Region, Vec<u8>)],
        running: &[(String, Vec<f32>)],
    ) -> Result<()> {
        let mut scalars = None;
        for (r, bytes) in regions {
            match r {
                Region::W => {
                    self.step.executor_mut().upload_region_bytes(*r, bytes)?;
                    self.step.init_weights()?;
                }
                Region::S => scalars = Some(Scalars::from_bytes(bytes).map_err(AmpError::from)?),
                _ => self.step.executor_mut().upload_region_bytes(*r, bytes)?,
            }
        }
        if let Some(s) = scalars {
            self.step.restore_scalars(&s)?;
        }
        self.set_running_stats(running)?;
        self.stream
            .synchronize()
            .map_err(|e| driver("synchronize after restoring a checkpoint", e))
    }
}
