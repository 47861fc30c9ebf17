//! The engine's state in and out (blocking, for tests and checkpoints): a [`Snapshot`] of
//! everything a step reads and writes that outlives it, and its restore. (A checkpoint's state
//! is restored by [`crate::classifier::Classifier::load_state`], the same on every backend.)

use super::{driver, CudaClassifier, Result, Snapshot};
use crate::amp::plan::Region;

impl CudaClassifier {
    /// Downloads every region the plan has, each layer's running statistics and the metrics
    /// log (empty without one); blocking.
    ///
    /// # Errors
    /// A driver error.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut out = Snapshot {
            regions: Vec::new(),
            running: Vec::new(),
            log: Vec::new(),
        };
        out.regions = self.region_images(&Region::ALL)?;
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
}
