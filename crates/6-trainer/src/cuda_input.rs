//! The CUDA executor's training input: each batch made (and, for CIFAR-10, augmented) on a CPU
//! thread ahead of the step ([`data::Prefetch`]), then copied host → device on a stream of its
//! own into the second of two device input buffers while the current step trains
//! ([`DoubleInput`]: the copy waits for the step that last read its buffer, the step waits for
//! its copy, both through CUDA events). Before each step the current buffer is copied into
//! the network's input and the head's labels on the compute stream, outside the step's CUDA
//! graph, so one captured graph serves both buffers (`crates/3-amp/src/cuda/input.rs` says why).

use super::CudaTrainer;
use crate::{data, TrainError};
use cudnn_cbr::amp::cuda::DoubleInput;
use std::ops::Range;

/// The batches of one run of the training loop, made ahead and staged one step ahead.
pub(crate) struct Feed {
    batches: data::Prefetch,
    input: DoubleInput,
    /// The next batch index to stage.
    next: u64,
    /// One past the last batch index.
    end: u64,
}

fn bytes_of(images: &[half::f16], labels: &[i32]) -> (Vec<u8>, Vec<u8>) {
    (
        images.iter().flat_map(|v| v.to_le_bytes()).collect(),
        labels.iter().flat_map(|l| l.to_le_bytes()).collect(),
    )
}

impl CudaTrainer {
    /// Starts the input of training batches `indices`: the producer thread, the two device
    /// buffers, and the first batch staged.
    ///
    /// # Errors
    /// A driver error; a producer that stopped early.
    pub(crate) fn feed(&mut self, indices: Range<u64>) -> Result<Feed, TrainError> {
        let capacity = self.engine.image_bytes() + 4 * self.cfg.batch;
        let mut feed = Feed {
            // This rank's shards only (of global batches of `world × batch` images).
            batches: data::Prefetch::spawn_shards(
                self.data.clone(),
                self.cfg.batch,
                indices.clone(),
                self.rank(),
            ),
            input: DoubleInput::new(self.engine.stream(), capacity).map_err(super::amp_error)?,
            next: indices.start,
            end: indices.end,
        };
        self.stage_next(&mut feed)?;
        Ok(feed)
    }

    /// Stages the next batch of `feed` (nothing past its last), from the producer thread.
    ///
    /// # Errors
    /// A producer that stopped early; a driver error.
    pub(crate) fn stage_next(&self, feed: &mut Feed) -> Result<(), TrainError> {
        if feed.next >= feed.end {
            return Ok(());
        }
        let i = feed.next;
        let (images, labels) = feed.batches.next_shard(i)?;
        self.engine.check_host_batch(&images, &labels)?;
        let (x, y) = bytes_of(&images, &labels);
        feed.input.stage(i, &[&x, &y]).map_err(super::amp_error)?;
        feed.next += 1;
        Ok(())
    }

    /// Copies batch `i` (staged) into the network's input and the head's labels on the
    /// compute stream, after its host → device copy. Stage batch `i + 1` after enqueuing
    /// step `i` ([`CudaTrainer::stage_next`]): its copy then runs beside the step.
    ///
    /// # Errors
    /// A batch not staged (out of order); a driver error.
    pub(crate) fn take_batch(&mut self, feed: &mut Feed, i: u64) -> Result<(), TrainError> {
        Ok(self.engine.take_input(&mut feed.input, i)?)
    }
}
