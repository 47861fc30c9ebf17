//! A synthetic, deterministic, learnable image dataset: each class has a fixed random template
//! (smooth blobs per channel); a sample is its class template plus noise.

use crate::TrainError;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Sampler of labelled NHWC images.
#[derive(Debug, Clone)]
pub struct Synthetic {
    /// Image height = width.
    pub hw: usize,
    /// Channels.
    pub channels: usize,
    /// Number of classes.
    pub classes: usize,
    templates: Vec<Vec<f32>>,
    noise: f32,
}

pub(crate) use cudnn_cbr::net::{splitmix, uniform};

impl Synthetic {
    /// Templates for `classes` classes of `hw`×`hw`×`channels` images, from `seed`.
    pub fn new(hw: usize, channels: usize, classes: usize, seed: u64) -> Self {
        let mut s = seed ^ 0x5eed_da7a;
        let templates = (0..classes)
            .map(|_| {
                // A few Gaussian blobs per channel with random centres and signs.
                let blobs: Vec<(f32, f32, f32, usize)> = (0..3 * channels)
                    .map(|i| {
                        let cx = (uniform(&mut s) * 0.5 + 0.5) * hw as f32;
                        let cy = (uniform(&mut s) * 0.5 + 0.5) * hw as f32;
                        (cx, cy, uniform(&mut s).signum(), i % channels)
                    })
                    .collect();
                let mut t = vec![0.0f32; hw * hw * channels];
                let sigma2 = (hw as f32 / 4.0).powi(2);
                for y in 0..hw {
                    for x in 0..hw {
                        for &(cx, cy, sign, c) in &blobs {
                            let d2 = (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2);
                            t[(y * hw + x) * channels + c] += sign * (-d2 / sigma2).exp();
                        }
                    }
                }
                t
            })
            .collect();
        Synthetic {
            hw,
            channels,
            classes,
            templates,
            noise: 2.0,
        }
    }

    /// Batch `index` of `batch` images (NHWC FP16) and labels; the same index gives the same
    /// batch. Distinct `stream` values give disjoint sample streams (train vs held-out).
    pub fn batch(&self, batch: usize, index: u64, stream: u64) -> (Vec<f16>, Vec<i32>) {
        let mut s = index.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ stream.wrapping_mul(0x9e37_79b9);
        let per = self.hw * self.hw * self.channels;
        let mut images = vec![f16::ZERO; batch * per];
        let mut labels = Vec::with_capacity(batch);
        // Each image in FP32, then rounded to FP16 at once (round to nearest even, as
        // `f16::from_f32`; the slice conversion runs F16C where the CPU has it).
        let mut wide = vec![0.0f32; per];
        for b in 0..batch {
            let image = &mut images[b * per..(b + 1) * per];
            let label = (splitmix(&mut s) % self.classes as u64) as usize;
            labels.push(label as i32);
            for (w, t) in wide.iter_mut().zip(&self.templates[label]) {
                *w = t + self.noise * uniform(&mut s);
            }
            image.convert_from_f32_slice(&wide);
        }
        (images, labels)
    }
}

/// A source of labelled NHWC FP16 batches for the training loop: training batches by index
/// and held-out batches by index, each a pure function of its arguments (and of the seed the
/// dataset was made with), so a batch can be made ahead of the step on another thread.
pub trait Dataset: Send + Sync + std::fmt::Debug {
    /// Training batch `index` of `batch` images and their labels.
    fn train_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>);
    /// Held-out batch `index` of `batch` images and their labels.
    fn held_out_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>);

    /// The training set's size in images, where the data has epochs (`None`: a stream
    /// without end, the synthetic data). The loop evaluates the test set after each epoch.
    fn train_len(&self) -> Option<usize> {
        None
    }

    /// The held-out (test) set's size in images, where it is finite.
    fn held_out_len(&self) -> Option<usize> {
        None
    }

    /// Whether making a batch runs rayon's parallel iterators (the default: a dataset may).
    /// [`Prefetch`] then makes batches in a rayon pool of its own; a dataset that makes them
    /// on one thread says `false`, and its batches are made on the prefetch thread itself:
    /// a pool's idle workers would only spin on the cores the training step runs on.
    fn uses_rayon(&self) -> bool {
        true
    }

    /// Rank `rank`'s shard of training batch `index` of `world × batch` images: images
    /// `rank·batch .. (rank + 1)·batch` of [`Dataset::train_batch`] of `world × batch`, bit
    /// for bit (one rank: the batch itself). The default makes the whole batch and cuts it; a
    /// dataset whose images each depend only on their place in the batch (CIFAR-10's) makes
    /// the shard alone, so that each rank of a group decodes its own images only.
    ///
    /// # Errors
    /// [`TrainError::Config`] when `world × batch` overflows, `rank` is not below `world`, or
    /// the dataset made a batch of another size.
    fn train_shard(
        &self,
        batch: usize,
        index: u64,
        (rank, world): (usize, usize),
    ) -> Result<Batch, TrainError> {
        let global = global_batch(batch, (rank, world))?;
        crate::bookkeeping::shard(self.train_batch(global, index), batch, (rank, world))
    }
}

/// One training batch: NHWC FP16 images and their labels.
pub type Batch = (Vec<f16>, Vec<i32>);

/// The global batch of `world` shards of `batch` images, for rank `rank`.
///
/// # Errors
/// [`TrainError::Config`] when it overflows or `rank` is not below `world`.
pub(crate) fn global_batch(
    batch: usize,
    (rank, world): (usize, usize),
) -> Result<usize, TrainError> {
    batch
        .checked_mul(world)
        .filter(|_| rank < world)
        .ok_or_else(|| {
            TrainError::Config(format!(
                "rank {rank} of {world}: no shard of {batch} images in a global batch"
            ))
        })
}

/// The epochs a run of `steps` steps of `images_per_step` images completes over a training
/// set of `train_len` images, as the 1-based steps after which each ends: step `s` ends an
/// epoch when `⌊s·B/n⌋ > ⌊(s−1)·B/n⌋` (batches run on across epoch boundaries).
pub(crate) fn epoch_ends(train_len: usize, images_per_step: usize, steps: usize) -> Vec<usize> {
    let (n, b) = (train_len.max(1), images_per_step);
    (1..=steps)
        .filter(|&s| (s * b) / n > ((s - 1) * b) / n)
        .collect()
}

/// The test batches of `batch` images that cover a test set of `len` images once (the last
/// one wraps around to the first images).
pub(crate) fn test_batches(len: usize, batch: usize) -> u64 {
    len.div_ceil(batch.max(1)) as u64
}

impl Dataset for Synthetic {
    /// [`Synthetic::batch`] of stream 0, as the loop has always trained on.
    fn train_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        self.batch(batch, index, 0)
    }

    /// [`Synthetic::batch`] of stream 1.
    fn held_out_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        self.batch(batch, index, 1)
    }

    /// A batch is made on one thread.
    fn uses_rayon(&self) -> bool {
        false
    }
}

impl Dataset for crate::cifar::Cifar10 {
    /// [`Cifar10::train_batch`](crate::cifar::Cifar10::train_batch): shuffled, augmented.
    fn train_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        crate::cifar::Cifar10::train_batch(self, batch, index)
    }

    /// [`Cifar10::test_batch`](crate::cifar::Cifar10::test_batch): the test set, in order.
    fn held_out_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        crate::cifar::Cifar10::test_batch(self, batch, index)
    }

    fn train_len(&self) -> Option<usize> {
        Some(self.train().len())
    }

    fn held_out_len(&self) -> Option<usize> {
        Some(self.test().len())
    }

    /// [`Cifar10::train_images`](crate::cifar::Cifar10::train_images) of the rank's places
    /// alone.
    fn train_shard(
        &self,
        batch: usize,
        index: u64,
        (rank, world): (usize, usize),
    ) -> Result<Batch, TrainError> {
        let global = global_batch(batch, (rank, world))?;
        Ok(self.train_images(global, index, rank * batch..(rank + 1) * batch))
    }
}

/// Where the training images come from ([`TrainConfig::data`](crate::TrainConfig::data)).
///
/// `TrainConfig` is `Copy` and passed by value through every executor, so the folder is a
/// `&'static Path`: parsing (`FromStr`) leaks the parsed path once (a few bytes per
/// configuration parsed, for the life of the process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataSource {
    /// The synthetic dataset ([`Synthetic`]) of the configuration's seed and shapes.
    #[default]
    Synthetic,
    /// The CIFAR-10 binary files in this folder ([`crate::cifar`]); 32×32 images, 10 classes.
    Cifar10(&'static std::path::Path),
}

impl std::str::FromStr for DataSource {
    type Err = String;

    /// `synthetic` or `cifar10:DIR`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "synthetic" => Ok(DataSource::Synthetic),
            Some(("cifar10", dir)) if !dir.is_empty() => Ok(DataSource::Cifar10(Box::leak(
                std::path::PathBuf::from(dir).into_boxed_path(),
            ))),
            _ => Err(format!(
                "data must be `synthetic` or `cifar10:DIR` (a folder of the CIFAR-10 binary \
                 files), got `{s}`"
            )),
        }
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Synthetic => f.write_str("synthetic"),
            DataSource::Cifar10(dir) => write!(f, "cifar10:{}", dir.display()),
        }
    }
}

/// The dataset `cfg` trains on.
///
/// # Errors
/// [`crate::cifar::CifarError`] for a CIFAR-10 folder that cannot be read, or a configuration
/// whose image size or class count is not CIFAR-10's (32, 10).
pub(crate) fn open(
    cfg: &crate::TrainConfig,
) -> Result<std::sync::Arc<dyn Dataset>, crate::cifar::CifarError> {
    use crate::cifar::{Cifar10, CifarError, CLASSES, HW};
    match cfg.data {
        DataSource::Synthetic => Ok(std::sync::Arc::new(Synthetic::new(
            cfg.hw,
            cfg.channels,
            cfg.classes,
            cfg.seed,
        ))),
        DataSource::Cifar10(dir) => {
            if cfg.hw != HW || cfg.classes != CLASSES {
                return Err(CifarError::Shape {
                    needed: format!("image size {HW} and {CLASSES} classes"),
                    got: format!("image size {} and {} classes", cfg.hw, cfg.classes),
                });
            }
            Ok(std::sync::Arc::new(Cifar10::open(
                dir,
                cfg.channels,
                cfg.seed,
            )?))
        }
    }
}

/// Training batches `0..steps` made on a thread of their own, ahead of the step: at most
/// [`Prefetch::DEPTH`] wait in a bounded channel while the step runs. Dropping it stops the
/// producer (its next send fails) and joins it.
#[derive(Debug)]
pub struct Prefetch {
    rx: Option<std::sync::mpsc::Receiver<Result<Batch, TrainError>>>,
    producer: Option<std::thread::JoinHandle<()>>,
}

impl Prefetch {
    /// Batches made ahead of the one the step consumes.
    pub const DEPTH: usize = 2;

    /// Starts making `data`'s training batches `0..steps` of `batch` images.
    pub fn spawn(data: std::sync::Arc<dyn Dataset>, batch: usize, steps: u64) -> Self {
        Self::spawn_range(data, batch, 0..steps)
    }

    /// Starts making `data`'s training batches `indices` (in order) of `batch` images: a
    /// resumed run's batches start at its checkpoint's step.
    pub fn spawn_range(
        data: std::sync::Arc<dyn Dataset>,
        batch: usize,
        indices: std::ops::Range<u64>,
    ) -> Self {
        Self::spawn_shards(data, batch, indices, (0, 1))
    }

    /// Starts making rank `rank`'s shards of `batch` images ([`Dataset::train_shard`]) of
    /// `data`'s training batches `indices` of `world × batch` images, in order.
    pub fn spawn_shards(
        data: std::sync::Arc<dyn Dataset>,
        batch: usize,
        indices: std::ops::Range<u64>,
        (rank, world): (usize, usize),
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel(Self::DEPTH);
        // A batch's parallel decoding runs on a pool of its own: the CPU step blocks a worker
        // of the global pool while it waits for the batch, and with one worker
        // (`RAYON_NUM_THREADS=1`) decoding there would wait for that worker forever.
        let threads = rayon::current_num_threads();
        let producer = std::thread::Builder::new()
            .name("batch-prefetch".into())
            .spawn(move || {
                let pool = if data.uses_rayon() {
                    let Ok(pool) = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .thread_name(|i| format!("batch-decode-{i}"))
                        .build()
                    else {
                        // No batch: the consumer's `next_shard` says the producer stopped.
                        return;
                    };
                    Some(pool)
                } else {
                    None
                };
                for i in indices {
                    let make = || data.train_shard(batch, i, (rank, world));
                    let shard = match &pool {
                        Some(pool) => pool.install(make),
                        None => make(),
                    };
                    // After a refused shard, nothing more: the consumer reports it.
                    let last = shard.is_err();
                    if tx.send(shard).is_err() || last {
                        break;
                    }
                }
            })
            .ok();
        Prefetch {
            rx: Some(rx),
            producer,
        }
    }

    /// The next batch, in index order; `None` once `steps` have been taken, when the
    /// producer could not start or has died, or when the dataset refused the batch (see
    /// [`Prefetch::next_shard`] for why).
    pub fn next_batch(&mut self) -> Option<(Vec<f16>, Vec<i32>)> {
        self.next_shard(0).ok()
    }

    /// The next batch (or shard), in index order, which the caller numbers `index` for the
    /// error.
    ///
    /// # Errors
    /// The dataset's error for that batch ([`Dataset::train_shard`]); [`TrainError::Config`]
    /// when the producer stopped before it (all taken, or it could not start or died).
    pub fn next_shard(&mut self, index: u64) -> Result<Batch, TrainError> {
        match self.rx.as_ref().map(|rx| rx.recv()) {
            Some(Ok(shard)) => shard,
            _ => Err(TrainError::Config(format!(
                "the batch producer stopped before batch {index}"
            ))),
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        // Closing the channel first ends a producer blocked on a full one.
        self.rx = None;
        if let Some(p) = self.producer.take() {
            let _ = p.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{epoch_ends, test_batches, Dataset, Prefetch};
    use half::f16;
    use std::sync::Arc;

    /// A dataset whose batch holds, as its one label, the length of the name of the thread
    /// that made it (and whose first image element says whether it was a decode thread).
    #[derive(Debug)]
    struct WhereMade {
        rayon: bool,
    }

    impl Dataset for WhereMade {
        fn train_batch(&self, _: usize, _: u64) -> (Vec<f16>, Vec<i32>) {
            let name = std::thread::current().name().unwrap_or("").to_string();
            let decode = f16::from_f32(f32::from(u8::from(name.starts_with("batch-decode"))));
            let on_pool = rayon::current_thread_index().is_some();
            (vec![decode], vec![i32::from(on_pool)])
        }
        fn held_out_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
            self.train_batch(batch, index)
        }
        fn uses_rayon(&self) -> bool {
            self.rayon
        }
    }

    #[test]
    fn batches_made_on_one_thread_skip_the_decode_pool() {
        for rayon in [true, false] {
            let mut p = Prefetch::spawn(Arc::new(WhereMade { rayon }), 1, 3);
            for i in 0..3 {
                let (image, label) = p.next_shard(i).unwrap();
                // A dataset that may use rayon runs in the decode pool's workers; one that
                // does not runs on the prefetch thread, outside any pool.
                assert_eq!(
                    image[0].to_f32(),
                    f32::from(u8::from(rayon)),
                    "rayon {rayon}"
                );
                assert_eq!(label[0], i32::from(rayon), "rayon {rayon}");
            }
            assert!(p.next_shard(3).is_err(), "three batches only");
        }
    }

    #[test]
    fn epochs_end_where_the_images_seen_cross_a_multiple_of_the_set() {
        // 100 images, 8 per step: 104 seen after step 13, 200 after step 25.
        assert_eq!(epoch_ends(100, 8, 30), [13, 25]);
        // A step that is exactly an epoch ends it; 50 per step: every second step.
        assert_eq!(epoch_ends(100, 50, 6), [2, 4, 6]);
        // Several epochs in one step count once.
        assert_eq!(epoch_ends(3, 8, 2), [1, 2]);
        assert!(epoch_ends(100, 8, 12).is_empty());
        assert_eq!(test_batches(20, 8), 3);
        assert_eq!(test_batches(24, 8), 3);
        assert_eq!(test_batches(10_000, 256), 40);
    }
}
