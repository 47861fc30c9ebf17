//! The CIFAR-10 reader on small files generated in the exact binary format: decoding,
//! normalization into the network's NHWC layout, crop and flip, determinism, every malformed
//! case's typed error, and a short CPU training run on the files.

use cudnn_cbr_trainer::augment::{crop_for, epoch_permutation, Crop, PAD};
use cudnn_cbr_trainer::cifar::{
    read_file, read_records, Cifar10, CifarError, Records, HW, MEAN, RECORD_BYTES, STD, TEST_FILE,
    TRAIN_FILES,
};
use cudnn_cbr_trainer::{
    initial_master_weights, train, DataSource, Dataset, Device, Synthetic, TrainConfig, TrainError,
};
use half::f16;
use std::path::{Path, PathBuf};

/// Records per generated file.
const N: usize = 20;
/// The network's input channels in these tests (the trainer's default: R, G, B, 5 zeros).
const CH: usize = 8;

/// Byte of file `f`, record `r`, colour `c` at `(y, x)`: distinct enough to tell planes,
/// rows, columns and records apart.
fn pixel(f: usize, r: usize, c: usize, y: usize, x: usize) -> u8 {
    ((c * 85 + y * 7 + x * 3 + r * 11 + f * 29) % 256) as u8
}

fn label(f: usize, r: usize) -> u8 {
    ((f * 3 + r) % 10) as u8
}

/// One file of `n` records in the format: label byte, then R, G, B planes, row-major.
fn file_bytes(f: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * RECORD_BYTES);
    for r in 0..n {
        out.push(label(f, r));
        for c in 0..3 {
            for y in 0..HW {
                for x in 0..HW {
                    out.push(pixel(f, r, c, y, x));
                }
            }
        }
    }
    out
}

/// A fresh folder with the five training files (files 0..5) and the test file (file 5).
fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cifar10-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, file) in TRAIN_FILES.iter().chain([&TEST_FILE]).enumerate() {
        std::fs::write(dir.join(file), file_bytes(f, N)).unwrap();
    }
    dir
}

fn at(y: usize, x: usize, c: usize) -> usize {
    (y * HW + x) * CH + c
}

#[test]
fn records_decode_to_their_pixels_and_labels() {
    let dir = folder("decode");
    let r = read_file(&dir.join(TRAIN_FILES[1]), u64::MAX).unwrap();
    assert_eq!(r.len(), N);
    assert_eq!(r.labels, (0..N).map(|i| label(1, i)).collect::<Vec<_>>());
    // Record 4's green pixel at (y 2, x 30) sits at byte 1024 + 2·32 + 30 of its image.
    assert_eq!(
        r.pixels[4 * 3072 + 1024 + 2 * 32 + 30],
        pixel(1, 4, 1, 2, 30)
    );

    let data = Cifar10::open(&dir, CH, 1).unwrap();
    assert_eq!((data.train().len(), data.test().len()), (5 * N, N));
    // Debug output (a trainer's, say) summarizes instead of printing 3,072 bytes per image.
    assert!(format!("{data:?}").len() < 300, "{data:?}");
    // The test set is not augmented: batch 1 of 6 is records 6..12 of test_batch.bin, in order.
    let (images, labels) = data.test_batch(6, 1);
    assert_eq!(images.len(), 6 * HW * HW * CH);
    assert_eq!(
        labels,
        (6..12).map(|i| i32::from(label(5, i))).collect::<Vec<_>>()
    );
    for j in 0..6 {
        let img = &images[j * HW * HW * CH..(j + 1) * HW * HW * CH];
        for (y, x) in [(0, 0), (2, 30), (31, 5), (17, 17)] {
            for c in 0..3 {
                let v = pixel(5, 6 + j, c, y, x);
                let want = (f32::from(v) / 255.0 - MEAN[c]) / STD[c];
                let got = img[at(y, x, c)].to_f32();
                assert!(
                    (got - want).abs() <= 2e-3 * want.abs().max(1.0),
                    "image {j} ({y}, {x}) colour {c}: {got} vs {want}"
                );
                assert_eq!(img[at(y, x, c)], data.normalized(c, v));
            }
            // The network's extra input channels are zero.
            for c in 3..CH {
                assert_eq!(img[at(y, x, c)], f16::ZERO);
            }
        }
    }
    // The test set wraps around: batch 3 of 6 starts at record 18, then 0.
    let (_, labels) = data.test_batch(6, 3);
    assert_eq!(labels[2], i32::from(label(5, 0)));
}

/// A set of one black image but for a white green pixel at (12, 10), which every crop keeps.
fn one_pixel_set() -> Cifar10 {
    let mut pixels = vec![0u8; 3072];
    pixels[1024 + 12 * 32 + 10] = 255;
    let set = Records {
        labels: vec![7],
        pixels,
    };
    Cifar10::from_records(set.clone(), set, CH, 42).unwrap()
}

#[test]
fn crop_and_flip_move_a_known_pixel_where_expected() {
    let data = one_pixel_set();
    let white = data.normalized(1, 255);
    let black = data.normalized(1, 0);
    let batch = 64;
    let (images, labels) = data.train_batch(batch, 5);
    assert!(labels.iter().all(|&l| l == 7));
    let (mut flipped, mut offsets) = (0, std::collections::BTreeSet::new());
    for j in 0..batch {
        let Crop { dy, dx, flip } = crop_for(42, 5, j);
        flipped += usize::from(flip);
        offsets.insert((dy, dx));
        // The crop shifts the image by (PAD − dy, PAD − dx); the flip mirrors the result.
        let oy = 12 + PAD - dy;
        let ox = 10 + PAD - dx;
        let ox = if flip { HW - 1 - ox } else { ox };
        let img = &images[j * HW * HW * CH..(j + 1) * HW * HW * CH];
        let whites: Vec<(usize, usize)> = (0..HW * HW)
            .filter(|p| img[p * CH + 1] == white)
            .map(|p| (p / HW, p % HW))
            .collect();
        assert_eq!(
            whites,
            vec![(oy, ox)],
            "image {j}, crop {dy} {dx} flip {flip}"
        );
        // Every other green value is black, padding included (the image padded with zeros).
        let others = (0..HW * HW).filter(|&p| img[p * CH + 1] == black).count();
        assert_eq!(others, HW * HW - 1);
    }
    assert!((10..=54).contains(&flipped), "{flipped} of {batch} flipped");
    assert!(
        offsets.len() > 20,
        "only {} distinct offsets",
        offsets.len()
    );
    // The test batch is the image itself.
    let (test, _) = data.test_batch(1, 0);
    assert_eq!(test[at(12, 10, 1)], white);
}

#[test]
fn batches_are_deterministic_by_seed_and_index() {
    let dir = folder("seed");
    let a = Cifar10::open(&dir, CH, 9).unwrap();
    let b = Cifar10::open(&dir, CH, 9).unwrap();
    let c = Cifar10::open(&dir, CH, 10).unwrap();
    assert_eq!(a.train_batch(16, 3), b.train_batch(16, 3));
    assert_ne!(a.train_batch(16, 3), c.train_batch(16, 3));
    assert_ne!(a.train_batch(16, 3).0, a.train_batch(16, 4).0);
    // One epoch's worth of batches holds every training record once.
    let n = a.train().len();
    let mut labels: Vec<i32> = (0..5).flat_map(|i| a.train_batch(n / 5, i).1).collect();
    let mut want: Vec<i32> = a.train().labels.iter().map(|&l| i32::from(l)).collect();
    labels.sort_unstable();
    want.sort_unstable();
    assert_eq!(labels, want);
    // The order is the epoch's permutation of the seed.
    let p = epoch_permutation(9, 0, n);
    let (_, first) = a.train_batch(4, 0);
    let expect: Vec<i32> = p[..4]
        .iter()
        .map(|&r| i32::from(a.train().labels[r as usize]))
        .collect();
    assert_eq!(first, expect);
}

#[test]
fn the_synthetic_dataset_is_unchanged_behind_the_trait() {
    let s = Synthetic::new(16, 8, 8, 1);
    assert_eq!(s.train_batch(4, 2), s.batch(4, 2, 0));
    assert_eq!(s.held_out_batch(4, 2), s.batch(4, 2, 1));
}

/// A rank's shard of a global batch is that batch's images `rank·batch .. (rank + 1)·batch`
/// bit for bit, whether the dataset makes the shard alone (CIFAR-10: each image a function of
/// its place) or cuts the whole batch (the synthetic data); a shard that cannot exist is a
/// typed error.
#[test]
fn a_ranks_shard_is_its_slice_of_the_global_batch() {
    let dir = folder("shards");
    let cifar = Cifar10::open(&dir, CH, 9).unwrap();
    let synthetic = Synthetic::new(HW, CH, 10, 9);
    let sets: [(&str, &dyn Dataset); 2] = [("cifar10", &cifar), ("synthetic", &synthetic)];
    for (name, data) in sets {
        // Index 7 of 3 × 12 images crosses the 100-image epoch (positions 252..288).
        for (batch, world, index) in [(4, 2, 0u64), (12, 3, 7), (5, 1, 3)] {
            let (images, labels) = data.train_batch(batch * world, index);
            let per = images.len() / labels.len();
            for rank in 0..world {
                let (x, y) = data.train_shard(batch, index, (rank, world)).unwrap();
                assert_eq!(
                    y,
                    labels[rank * batch..(rank + 1) * batch],
                    "{name} {rank}/{world}"
                );
                assert!(
                    x == images[rank * batch * per..(rank + 1) * batch * per],
                    "{name}: rank {rank} of {world}, batch {index}: other images"
                );
            }
        }
        for (batch, rank, world) in [(4, 2, 2), (usize::MAX / 2, 0, 3)] {
            let e = data.train_shard(batch, 0, (rank, world)).unwrap_err();
            assert!(matches!(e, TrainError::Config(_)), "{name}: {e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn path_of(e: &CifarError) -> &Path {
    match e {
        CifarError::Missing { path }
        | CifarError::NotRegular { path, .. }
        | CifarError::TooLarge { path, .. }
        | CifarError::BadSize { path, .. }
        | CifarError::ShortRecord { path, .. }
        | CifarError::BadLabel { path, .. }
        | CifarError::Empty { path }
        | CifarError::Io { path, .. } => path,
        CifarError::Shape { .. } => Path::new(""),
    }
}

/// Opens `dir` after `spoil` has changed `TRAIN_FILES[2]`; the error, which names that file.
fn open_spoiled(name: &str, spoil: impl FnOnce(&Path)) -> CifarError {
    let dir = folder(name);
    let file = dir.join(TRAIN_FILES[2]);
    spoil(&file);
    let e = Cifar10::open(&dir, CH, 1).unwrap_err();
    assert_eq!(path_of(&e), file, "{e}");
    assert!(e.to_string().contains(TRAIN_FILES[2]), "{e}");
    e
}

#[test]
fn every_malformed_case_is_its_typed_error() {
    let e = open_spoiled("size", |f| {
        std::fs::write(f, &file_bytes(2, 3)[..3 * RECORD_BYTES - 5]).unwrap()
    });
    assert!(
        matches!(e, CifarError::BadSize { size, .. } if size == 3 * RECORD_BYTES as u64 - 5),
        "{e}"
    );

    let e = open_spoiled("label", |f| {
        let mut b = file_bytes(2, N);
        b[7 * RECORD_BYTES] = 12;
        std::fs::write(f, b).unwrap()
    });
    assert!(
        matches!(
            e,
            CifarError::BadLabel {
                record: 7,
                label: 12,
                ..
            }
        ),
        "{e}"
    );

    let e = open_spoiled("missing", |f| std::fs::remove_file(f).unwrap());
    assert!(matches!(e, CifarError::Missing { .. }), "{e}");

    let e = open_spoiled("folder", |f| {
        std::fs::remove_file(f).unwrap();
        std::fs::create_dir(f).unwrap();
    });
    assert!(
        matches!(e, CifarError::NotRegular { kind: "folder", .. }),
        "{e}"
    );

    // Opening a FIFO for reading would wait for a writer: the reader must not open it.
    let e = open_spoiled("fifo", |f| {
        std::fs::remove_file(f).unwrap();
        let ok = std::process::Command::new("mkfifo")
            .arg(f)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mkfifo failed");
    });
    assert!(
        matches!(e, CifarError::NotRegular { kind: "FIFO", .. }),
        "{e}"
    );

    let e = open_spoiled("empty", |f| std::fs::write(f, []).unwrap());
    assert!(matches!(e, CifarError::Empty { .. }), "{e}");

    // Over the size limit: 20 records with a limit of 10.
    let dir = folder("limit");
    let limit = 10 * RECORD_BYTES as u64;
    let e = Cifar10::open_with_limit(&dir, CH, 1, limit).unwrap_err();
    assert!(
        matches!(&e, CifarError::TooLarge { path, size, limit: l }
            if path.ends_with(TRAIN_FILES[0]) && *size == (N * RECORD_BYTES) as u64 && *l == limit),
        "{e}"
    );

    // A stream that ends inside record 2 (of a source whose size is not known in advance).
    let bytes = file_bytes(0, 3);
    let name = Path::new("stream.bin");
    let e = read_records(&bytes[..2 * RECORD_BYTES + 100], name, u64::MAX).unwrap_err();
    assert!(
        matches!(
            e,
            CifarError::ShortRecord {
                record: 2,
                got: 100,
                ..
            }
        ),
        "{e}"
    );
    // And one longer than its limit stops reading there.
    let e = read_records(&bytes[..], name, 2 * RECORD_BYTES as u64).unwrap_err();
    assert!(matches!(e, CifarError::TooLarge { .. }), "{e}");
    assert_eq!(read_records(&bytes[..], name, u64::MAX).unwrap().len(), 3);

    // Records built in memory are checked as files are.
    let good = Records {
        labels: vec![1],
        pixels: vec![0; 3072],
    };
    for bad in [
        Records::default(),
        Records {
            labels: vec![10],
            pixels: vec![0; 3072],
        },
        Records {
            labels: vec![1, 2],
            pixels: vec![0; 3072],
        },
    ] {
        let e = Cifar10::from_records(good.clone(), bad.clone(), CH, 1).unwrap_err();
        assert!(matches!(e, CifarError::Shape { .. }), "{bad:?}: {e}");
    }

    // Too few input channels for R, G and B.
    let e = Cifar10::open(&folder("channels"), 2, 1).unwrap_err();
    assert!(matches!(e, CifarError::Shape { .. }), "{e}");
}

#[test]
fn data_sources_parse() {
    assert_eq!("synthetic".parse::<DataSource>(), Ok(DataSource::Synthetic));
    assert_eq!(
        "cifar10:/data/cifar".parse::<DataSource>(),
        Ok(DataSource::Cifar10(Path::new("/data/cifar")))
    );
    for bad in ["cifar10:", "imagenet:/x", "", "cifar10"] {
        assert!(bad.parse::<DataSource>().is_err(), "{bad}");
    }
}

fn cifar_config(dir: PathBuf) -> TrainConfig {
    TrainConfig {
        steps: 3,
        batch: 8,
        hw: HW,
        classes: 10,
        device: Device::Cpu,
        data: DataSource::Cifar10(Box::leak(dir.into_boxed_path())),
        ..TrainConfig::default()
    }
}

#[test]
fn three_cpu_steps_train_on_the_files() {
    let cfg = cifar_config(folder("train"));
    let r = train(&cfg, 1, |p| assert!(p.loss.is_finite(), "{p:?}")).unwrap();
    println!("{r:?}");
    assert_eq!(r.step_losses.len(), 3);
    assert!(r.step_losses.iter().all(|l| l.is_finite()));
    // Ten classes: the first losses are near ln 10 ≈ 2.3.
    assert!(r.first_loss > 1.0 && r.first_loss < 5.0, "{r:?}");
    assert_eq!(r.executor.kind, cudnn_cbr_trainer::ExecutorKind::Cpu);
    // The same files and seed train to the same losses, bit for bit.
    let again = train(&cfg, 3, |_| {}).unwrap();
    assert_eq!(r.step_losses, again.step_losses);

    // What the files cannot train: another image size, a bad folder. (CUDA
    // trains on them, crates/6-trainer/tests/sim_cifar.rs; without a device it is unavailable, not a
    // configuration error.)
    let e = train(&TrainConfig { hw: 16, ..cfg }, 1, |_| {}).unwrap_err();
    assert!(
        matches!(e, TrainError::Data(CifarError::Shape { .. })),
        "{e}"
    );
    let e = train(
        &TrainConfig {
            device: Device::Cuda,
            ..cfg
        },
        1,
        |_| {},
    )
    .map(|_| ());
    assert!(
        e.as_ref().map_or_else(|e| e.is_unavailable(), |_| true),
        "{e:?}"
    );
    let bad = cifar_config(std::env::temp_dir().join("cifar10-no-such-folder"));
    let e = train(&bad, 1, |_| {}).unwrap_err();
    assert!(
        matches!(e, TrainError::Data(CifarError::Missing { .. })),
        "{e}"
    );
}

/// Data parallelism on the files: `--ranks 2 --batch 8 --sync-bn` trains like `--batch 16`
/// (the same global batches, each rank decoding its half), the test set is evaluated after
/// each epoch by the group, and local BN is another training.
#[test]
fn two_synchronized_cpu_ranks_train_on_the_files_like_one_rank() {
    // 100 training images, 16 per step: epochs end after steps 7 and 13.
    let one = TrainConfig {
        steps: 14,
        batch: 16,
        ..cifar_config(folder("ranks"))
    };
    let two = TrainConfig {
        batch: 8,
        ranks: 2,
        sync_bn: true,
        ..one
    };
    let a = train(&one, 100, |_| {}).unwrap();
    let b = train(&two, 100, |_| {}).unwrap();
    let local = train(
        &TrainConfig {
            sync_bn: false,
            ..two
        },
        100,
        |_| {},
    )
    .unwrap();
    // The weights' distance from one rank's, relative to how far one rank moved them.
    let flat = |w: &cudnn_cbr_trainer::MasterWeights| -> Vec<f64> {
        w.0.iter()
            .flat_map(|(_, v)| v.iter().map(|&x| f64::from(x)))
            .collect()
    };
    let (w0, wa) = (
        flat(&initial_master_weights(&one).unwrap()),
        flat(&a.weights),
    );
    let apart = |w: &[f64]| -> f64 {
        let d: f64 = w.iter().zip(&wa).map(|(x, y)| (x - y).powi(2)).sum();
        let m: f64 = wa.iter().zip(&w0).map(|(x, y)| (x - y).powi(2)).sum();
        (d / m).sqrt()
    };
    let (sync, unsync) = (apart(&flat(&b.weights)), apart(&flat(&local.weights)));
    println!(
        "1 rank x 16 vs 2 ranks x 8 on the files after 14 steps: |W - W_one| / |W_one - W0| = \
         {sync:.2e} with synchronized BN, {unsync:.2e} with local BN; epochs {:?} vs {:?}",
        a.epochs, b.epochs
    );
    // Step 1 sees the same weights and images: with synchronized BN the same statistics, so
    // the same loss up to the order of the ranks' sums (measured: equal); FP16 rounding of the
    // summed wgrads then enters (measured at most 1.1e-5 through step 3). Local BN normalizes
    // each half by its own statistics: measured 9.3e-4 to 1.8e-3 from step 1. 1e-4 sits
    // between, with a margin of 9 on each side.
    for (k, ((x, y), z)) in a
        .step_losses
        .iter()
        .zip(&b.step_losses)
        .zip(&local.step_losses)
        .enumerate()
        .take(3)
    {
        assert!(
            (x - y).abs() < 1e-4,
            "step {}: one rank {x}, two ranks {y}",
            k + 1
        );
        assert!(
            (x - z).abs() > 1e-4,
            "step {}: local BN is another training ({x}, {z})",
            k + 1
        );
    }
    // Over 14 steps the roundings grow (the loss stays near ln 10, where SGD on these few
    // images moves the weights little and chaotically): measured 4.7e-2 of the movement, and
    // 0.30 with local BN. A rank's gradient lost or counted twice moves them by O(1).
    assert!(sync < 0.15, "synchronized BN: {sync:.2e}");
    let steps = |r: &cudnn_cbr_trainer::TrainReport| -> Vec<usize> {
        r.epochs.iter().map(|e| e.step).collect()
    };
    assert_eq!(steps(&a), [7, 13]);
    assert_eq!(steps(&b), [7, 13]);
    // 20 test images in batches of 16 (the second wrapping around): 32 predictions, of which
    // an image whose top two logits are within the runs' rounding may flip; two allow that.
    for (x, y) in a.epochs.iter().zip(&b.epochs) {
        assert!(
            (x.accuracy - y.accuracy).abs() <= 2.0 / 32.0 + 1e-6,
            "{x:?} vs {y:?}"
        );
    }
}

/// `Trainer::evaluate` on the files: the checkpoint of a run whose last step ends an epoch
/// evaluates the whole test set to that epoch's accuracy, bit for bit.
#[test]
fn a_checkpoint_evaluates_the_test_set_as_its_last_epoch_did() {
    use cudnn_cbr_trainer::Trainer;
    let dir = folder("evaluate");
    // 100 training images, 16 per step: the first epoch ends after step 7, the last.
    let cfg = TrainConfig {
        steps: 7,
        batch: 16,
        ..cifar_config(dir.clone())
    };
    let path = dir.join("ck.safetensors");
    let mut t = Trainer::new(&cfg).unwrap();
    t.save_to(&path, 0).unwrap();
    let r = t.run(7, |_| {}).unwrap();
    assert_eq!(r.epochs.len(), 1);
    let mut again = Trainer::new(&cfg).unwrap();
    again.load_checkpoint(&path).unwrap();
    let e = again.evaluate().unwrap();
    println!("{e:?}; the run's epoch {:?}", r.epochs[0]);
    assert_eq!(e.test_set, Some((r.epochs[0].accuracy, None)));
    assert_eq!(e.held_out_accuracy, r.held_out_accuracy);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Set in the child run of [`one_rayon_worker_trains_on_the_files`].
const ONE_WORKER_CHILD: &str = "CUDNN_CBR_TEST_ONE_WORKER_CHILD";

/// With one rayon worker (`RAYON_NUM_THREADS=1`) the CPU step holds that worker while it waits
/// for the next batch, so the batch's parallel decoding must not need it: it did, and the run
/// hung before its first step. In a child process (the variable sizes the global pool when it
/// starts); still running after the deadline is a failure, the child killed.
#[test]
fn one_rayon_worker_trains_on_the_files() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    if std::env::var_os(ONE_WORKER_CHILD).is_some() {
        let r = train(&cifar_config(folder("one-worker")), 1, |_| {}).unwrap();
        assert_eq!(rayon::current_num_threads(), 1);
        assert_eq!(r.step_losses.len(), 3);
        println!("ONE WORKER TRAINED");
        return;
    }
    let dir = folder("one-worker-parent");
    let log = dir.join("child.log");
    let mut child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "one_rayon_worker_trains_on_the_files",
            "--exact",
            "--nocapture",
        ])
        .env(ONE_WORKER_CHILD, "1")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the child run");
    // Three steps of 8 images take well under a second here; two minutes leave room for a
    // slow, loaded machine and still end a hang.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("three CPU steps on one rayon worker still ran after 120 s: a hang");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "the child run failed:\n{out}");
    assert!(
        out.contains("ONE WORKER TRAINED"),
        "the child did not train:\n{out}"
    );
}
