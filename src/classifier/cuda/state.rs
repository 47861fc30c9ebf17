//! The engine's state in and out (blocking, for tests and checkpoints): a [`Snapshot`] of
//! everything a step reads and writes that outlives it, and the restore of a checkpoint's
//! regions and running statistics.

use super::{driver, CudaClassifier, Result, Snapshot};
use crate::amp::plan::Region;
use crate::amp::range::Scalars;
use crate::amp::AmpError;

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
        if let Some(log) = &self.backend.head.log {
            out.log = self
                .backend
                .stream
                .clone_dtoh(log)
                .map_err(|e| driver("download the metrics log", e))?;
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
        if let Some(log) = self.backend.head.log.as_mut() {
            self.backend
                .stream
                .memcpy_htod(&s.log, log)
                .map_err(|e| driver("restore the metrics log", e))?;
        }
        Ok(())
    }

    /// Uploads running statistics by buffer name (in stream order).
    fn set_running_stats(&mut self, running: &[(String, Vec<f32>)]) -> Result<()> {
        for (name, v) in running {
            self.set_running_stat(name, v.clone())?;
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
        self.backend
            .stream
            .synchronize()
            .map_err(|e| driver("synchronize after restoring a checkpoint", e))
    }
}
