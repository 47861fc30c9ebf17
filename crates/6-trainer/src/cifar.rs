//! The CIFAR-10 binary format, read from a folder, normalized per channel and (for training)
//! augmented, as NHWC FP16 batches in the layout [`Synthetic::batch`](crate::Synthetic::batch)
//! produces.
//!
//! The folder holds `data_batch_1.bin` … `data_batch_5.bin` (the training set) and
//! `test_batch.bin` (the test set). Each file is a run of records of 3,073 bytes: one label
//! byte (0..=9), then 3,072 image bytes — 1,024 red, 1,024 green, 1,024 blue, each plane a
//! row-major 32×32 image. The official files hold 10,000 records each; fewer are accepted
//! (small files in tests), but only whole records.
//!
//! Normalization uses the standard CIFAR-10 constants ([`MEAN`], [`STD`]: the per-channel
//! mean and standard deviation of the 50,000 official training images, pixels scaled to
//! [0, 1]), not statistics of the files read, so a subset normalizes like the full set.
//! Channels beyond the three colours (the network's input may be wider:
//! [`TrainConfig::channels`](crate::TrainConfig::channels)) are zero.

use crate::augment::{self, Crop};
use half::f16;
use rayon::prelude::*;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// Image height and width.
pub const HW: usize = 32;
/// Classes.
pub const CLASSES: usize = 10;
/// Bytes of one record: the label and the three colour planes.
pub const RECORD_BYTES: usize = 1 + 3 * HW * HW;
/// Records of an official file.
pub const OFFICIAL_RECORDS: u64 = 10_000;
/// The default size limit of one file: an official file's size (10,000 records).
pub const DEFAULT_FILE_LIMIT: u64 = OFFICIAL_RECORDS * RECORD_BYTES as u64;
/// The training files, in order.
pub const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];
/// The test file.
pub const TEST_FILE: &str = "test_batch.bin";
/// Per-channel (R, G, B) mean of the official training set, pixels in [0, 1].
pub const MEAN: [f32; 3] = [0.491_399_7, 0.482_158_4, 0.446_530_9];
/// Per-channel (R, G, B) standard deviation of the official training set, pixels in [0, 1].
pub const STD: [f32; 3] = [0.247_032_2, 0.243_485_1, 0.261_587_8];

/// What is wrong with a CIFAR-10 folder or file.
#[derive(Debug, thiserror::Error)]
pub enum CifarError {
    /// A file of the format is not in the folder.
    #[error("CIFAR-10 file {} is missing", path.display())]
    Missing {
        /// The file expected.
        path: PathBuf,
    },
    /// The path exists but is not a regular file (a folder, a FIFO, a device, a socket).
    #[error("CIFAR-10 file {} is not a regular file but a {kind}", path.display())]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The file is larger than the reader's limit.
    #[error("CIFAR-10 file {} is {size} bytes, over the limit of {limit} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (at least; reading stops past the limit).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The file's size is not a whole number of records.
    #[error(
        "CIFAR-10 file {} is {size} bytes, not a multiple of {RECORD_BYTES} (a label byte and \
         3,072 image bytes per record)",
        path.display()
    )]
    BadSize {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The data ended inside a record.
    #[error(
        "CIFAR-10 file {}: record {record} is truncated ({got} of {RECORD_BYTES} bytes)",
        path.display()
    )]
    ShortRecord {
        /// The file.
        path: PathBuf,
        /// The record's index (from 0).
        record: u64,
        /// Bytes of it present.
        got: usize,
    },
    /// A label byte is not a class.
    #[error(
        "CIFAR-10 file {}: record {record} has label {label}, not in 0..=9",
        path.display()
    )]
    BadLabel {
        /// The file.
        path: PathBuf,
        /// The record's index (from 0).
        record: u64,
        /// The byte read.
        label: u8,
    },
    /// The file holds no record.
    #[error("CIFAR-10 file {} holds no records", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// Reading failed.
    #[error("cannot read CIFAR-10 file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        source: io::Error,
    },
    /// The network's input cannot take the images.
    #[error("CIFAR-10 images need {needed}, the network is configured with {got}")]
    Shape {
        /// What the images need.
        needed: String,
        /// What the configuration has.
        got: String,
    },
}

/// Decoded records: labels and the raw image bytes (3,072 per record, planar R, G, B). Its
/// `Debug` output is a summary, not the bytes.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Records {
    /// One label (0..=9) per record.
    pub labels: Vec<u8>,
    /// `3 × 32 × 32` bytes per record, as stored (channel-major planes).
    pub pixels: Vec<u8>,
}

impl Records {
    /// Number of records.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Record `i`'s image bytes.
    fn image(&self, i: usize) -> &[u8] {
        &self.pixels[i * (RECORD_BYTES - 1)..(i + 1) * (RECORD_BYTES - 1)]
    }

    fn extend(&mut self, other: Records) {
        self.labels.extend(other.labels);
        self.pixels.extend(other.pixels);
    }
}

fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "folder"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else if ft.is_block_device() || ft.is_char_device() {
        "device"
    } else {
        "non-regular file"
    }
}

/// Reads one file of the format, at most `limit` bytes.
///
/// The path's metadata is checked before it is opened (opening a FIFO for reading would wait
/// for a writer): it must be a regular file (a symbolic link to one is followed), no larger
/// than `limit`, and a whole, non-zero number of records. The opened file's metadata is
/// checked again, and the reading itself stops past `limit`, so a file that changes between
/// the checks and the read cannot make it read more.
///
/// # Errors
/// [`CifarError::Missing`], [`CifarError::NotRegular`], [`CifarError::TooLarge`],
/// [`CifarError::BadSize`], [`CifarError::Empty`], and those of [`read_records`].
pub fn read_file(path: &Path, limit: u64) -> Result<Records, CifarError> {
    let io = |source| CifarError::Io {
        path: path.to_owned(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CifarError::Missing {
                path: path.to_owned(),
            })
        }
        Err(e) => return Err(io(e)),
    };
    let check = |meta: &std::fs::Metadata| -> Result<(), CifarError> {
        if !meta.is_file() {
            return Err(CifarError::NotRegular {
                path: path.to_owned(),
                kind: kind_of(meta.file_type()),
            });
        }
        let size = meta.len();
        if size > limit {
            return Err(CifarError::TooLarge {
                path: path.to_owned(),
                size,
                limit,
            });
        }
        if !size.is_multiple_of(RECORD_BYTES as u64) {
            return Err(CifarError::BadSize {
                path: path.to_owned(),
                size,
            });
        }
        Ok(())
    };
    check(&meta)?;
    let file = File::open(path).map_err(io)?;
    check(&file.metadata().map_err(io)?)?;
    read_records(file, path, limit)
}

/// Decodes records from `reader` (named `path` in errors), reading at most `limit` bytes.
///
/// # Errors
/// [`CifarError::ShortRecord`] when the data ends inside a record, [`CifarError::BadLabel`]
/// for a label over 9, [`CifarError::TooLarge`] past `limit`, [`CifarError::Empty`] for no
/// data, [`CifarError::Io`] for a failed read.
pub fn read_records(reader: impl Read, path: &Path, limit: u64) -> Result<Records, CifarError> {
    // One byte past the limit tells "exactly the limit" from "more".
    let mut reader = reader.take(limit.saturating_add(1));
    let mut records = Records::default();
    let mut record = vec![0u8; RECORD_BYTES];
    let mut total = 0u64;
    for index in 0u64.. {
        let got = read_full(&mut reader, &mut record).map_err(|source| CifarError::Io {
            path: path.to_owned(),
            source,
        })?;
        total += got as u64;
        if total > limit {
            return Err(CifarError::TooLarge {
                path: path.to_owned(),
                size: total,
                limit,
            });
        }
        if got == 0 {
            break;
        }
        if got < RECORD_BYTES {
            return Err(CifarError::ShortRecord {
                path: path.to_owned(),
                record: index,
                got,
            });
        }
        if record[0] as usize >= CLASSES {
            return Err(CifarError::BadLabel {
                path: path.to_owned(),
                record: index,
                label: record[0],
            });
        }
        records.labels.push(record[0]);
        records.pixels.extend_from_slice(&record[1..]);
    }
    if records.is_empty() {
        return Err(CifarError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(records)
}

/// Fills `buf` from `reader` as far as it goes; the bytes read (fewer only at the end).
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("records", &self.labels.len())
            .field("pixel_bytes", &self.pixels.len())
            .finish()
    }
}

/// The CIFAR-10 training and test sets, in memory, with the batch layout of the network.
/// Its `Debug` output is a summary.
#[derive(Clone)]
pub struct Cifar10 {
    train: Records,
    test: Records,
    channels: usize,
    seed: u64,
    /// `lut[c][v]`: pixel value `v` of colour `c` normalized, in FP16.
    lut: [[f16; 256]; 3],
}

impl std::fmt::Debug for Cifar10 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cifar10")
            .field("train", &self.train)
            .field("test", &self.test)
            .field("channels", &self.channels)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl Cifar10 {
    /// Reads the six files of `dir` ([`TRAIN_FILES`], [`TEST_FILE`]), each at most
    /// [`DEFAULT_FILE_LIMIT`] bytes, for NHWC batches of `channels` channels (at least 3:
    /// R, G, B, then zeros); `seed` drives the shuffling and augmentation of training batches.
    ///
    /// # Errors
    /// [`CifarError::Shape`] for `channels < 3`; any error of [`read_file`], naming the file.
    pub fn open(dir: &Path, channels: usize, seed: u64) -> Result<Self, CifarError> {
        Self::open_with_limit(dir, channels, seed, DEFAULT_FILE_LIMIT)
    }

    /// As [`Cifar10::open`] with a size limit of `limit` bytes per file.
    ///
    /// # Errors
    /// As [`Cifar10::open`].
    pub fn open_with_limit(
        dir: &Path,
        channels: usize,
        seed: u64,
        limit: u64,
    ) -> Result<Self, CifarError> {
        let mut train = Records::default();
        for name in TRAIN_FILES {
            train.extend(read_file(&dir.join(name), limit)?);
        }
        let test = read_file(&dir.join(TEST_FILE), limit)?;
        Self::from_records(train, test, channels, seed)
    }

    /// From decoded records, for batches of `channels` channels (R, G, B, then zeros).
    ///
    /// # Errors
    /// [`CifarError::Shape`] for `channels < 3`, an empty set, a label over 9, or pixels that
    /// are not 3,072 bytes per label.
    pub fn from_records(
        train: Records,
        test: Records,
        channels: usize,
        seed: u64,
    ) -> Result<Self, CifarError> {
        if channels < 3 {
            return Err(CifarError::Shape {
                needed: "at least 3 input channels".into(),
                got: format!("{channels}"),
            });
        }
        for (name, set) in [("training", &train), ("test", &test)] {
            if set.is_empty()
                || set.pixels.len() != set.len() * (RECORD_BYTES - 1)
                || set.labels.iter().any(|&l| usize::from(l) >= CLASSES)
            {
                return Err(CifarError::Shape {
                    needed: format!(
                        "a non-empty {name} set of labels in 0..=9 and 3,072 pixel bytes each"
                    ),
                    got: format!(
                        "{} labels (largest {:?}) and {} pixel bytes",
                        set.len(),
                        set.labels.iter().max(),
                        set.pixels.len()
                    ),
                });
            }
        }
        let mut lut = [[f16::ZERO; 256]; 3];
        for (c, row) in lut.iter_mut().enumerate() {
            for (v, out) in row.iter_mut().enumerate() {
                *out = f16::from_f32((v as f32 / 255.0 - MEAN[c]) / STD[c]);
            }
        }
        Ok(Cifar10 {
            train,
            test,
            channels,
            seed,
            lut,
        })
    }

    /// The training records.
    pub fn train(&self) -> &Records {
        &self.train
    }

    /// The test records.
    pub fn test(&self) -> &Records {
        &self.test
    }

    /// Channels of a batch's images.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Pixel value `v` of colour `c` (0 R, 1 G, 2 B) as the batches hold it:
    /// `(v / 255 − MEAN[c]) / STD[c]` rounded to FP16.
    pub fn normalized(&self, c: usize, v: u8) -> f16 {
        self.lut[c][usize::from(v)]
    }

    /// Training batch `index` of `batch` images, augmented: the records at positions
    /// `index × batch …` of the training stream (each epoch a permutation of the training
    /// set: [`augment::epoch_permutation`]), each cropped and flipped as
    /// [`augment::crop_for`] chooses from the seed, the batch index and its place in the
    /// batch. The same seed and index give the same batch, bit for bit.
    pub fn train_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        self.train_images(batch, index, 0..batch)
    }

    /// Images `places` of [`Cifar10::train_batch`] of `batch` images, made alone (each image
    /// depends only on the seed, the batch index and its place): a rank's shard.
    pub fn train_images(
        &self,
        batch: usize,
        index: u64,
        places: std::ops::Range<usize>,
    ) -> (Vec<f16>, Vec<i32>) {
        let n = self.train.len() as u64;
        let first = index.wrapping_mul(batch as u64);
        let mut perm: Option<(u64, Vec<u32>)> = None;
        let records: Vec<usize> = places
            .clone()
            .map(|j| {
                let pos = first.wrapping_add(j as u64);
                let epoch = pos / n;
                if perm.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    perm = Some((
                        epoch,
                        augment::epoch_permutation(self.seed, epoch, n as usize),
                    ));
                }
                perm.as_ref()
                    .map_or(0, |(_, p)| p[(pos % n) as usize] as usize)
            })
            .collect();
        let crops: Vec<Crop> = places
            .map(|j| augment::crop_for(self.seed, index, j))
            .collect();
        self.assemble(&self.train, &records, Some(&crops))
    }

    /// Test batch `index` of `batch` images, not augmented: test records `index × batch …`
    /// in file order, wrapping around at the end of the test set.
    pub fn test_batch(&self, batch: usize, index: u64) -> (Vec<f16>, Vec<i32>) {
        let n = self.test.len() as u64;
        let first = index.wrapping_mul(batch as u64);
        let records: Vec<usize> = (0..batch as u64)
            .map(|j| (first.wrapping_add(j) % n) as usize)
            .collect();
        self.assemble(&self.test, &records, None)
    }

    /// NHWC FP16 images and labels of `records`, each cropped and flipped by `crops` when
    /// given; one image per rayon task.
    fn assemble(
        &self,
        set: &Records,
        records: &[usize],
        crops: Option<&[Crop]>,
    ) -> (Vec<f16>, Vec<i32>) {
        let per = HW * HW * self.channels;
        let mut images = vec![f16::ZERO; records.len() * per];
        images.par_chunks_mut(per).enumerate().for_each(|(j, out)| {
            let crop = crops.map_or(Crop::IDENTITY, |c| c[j]);
            self.write_image(set.image(records[j]), crop, out);
        });
        let labels = records.iter().map(|&r| i32::from(set.labels[r])).collect();
        (images, labels)
    }

    /// Writes one planar image into `out` (NHWC, `self.channels` channels), through `crop`.
    /// Pixels the crop takes from the padding are black (byte 0) before normalization, as
    /// padding the image bytes with zeros would make them.
    fn write_image(&self, planar: &[u8], crop: Crop, out: &mut [f16]) {
        let ch = self.channels;
        for y in 0..HW {
            for x in 0..HW {
                let src = crop.source(y, x);
                let px = &mut out[(y * HW + x) * ch..(y * HW + x) * ch + 3];
                for (c, v) in px.iter_mut().enumerate() {
                    let byte = src.map_or(0, |(sy, sx)| planar[c * HW * HW + sy * HW + sx]);
                    *v = self.lut[c][usize::from(byte)];
                }
            }
        }
    }
}
