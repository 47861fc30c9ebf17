//! Checkpoint and resume on the CPU executor: N steps in one go equal k steps, a checkpoint,
//! and N − k steps in a new process (the same per-step losses and weights hash, bit for bit);
//! bad files are typed errors naming the tensor; a failed save leaves the old file; training
//! curves are written when asked.

mod common;

use cudnn_cbr_trainer::checkpoint::{self, CheckpointError, SCALARS};
use cudnn_cbr_trainer::{TrainConfig, TrainError, Trainer};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `train_cbr` example next to this test binary.
fn train_cbr() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    [
        dir.join("../examples/train_cbr"),
        dir.join("example-train_cbr"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("train_cbr is built (`cargo build --release -p cudnn-cbr-trainer --examples`)")
}

/// A fresh folder for one test.
fn folder(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cbr-ck-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// (weights hash, first step of the losses, per-step losses as printed) of a train_cbr run.
fn run(args: &[&str]) -> (String, usize, Vec<String>, String) {
    let out = Command::new(train_cbr()).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "train_cbr {args:?} failed:\n{text}");
    let hash = text
        .lines()
        .find(|l| l.starts_with("train_cbr summary:"))
        .and_then(|l| l.rsplit_once("weights hash "))
        .map(|(_, h)| h.trim().to_string())
        .unwrap_or_else(|| panic!("no summary line with a hash:\n{text}"));
    assert_eq!(hash.len(), 16, "{hash}");
    assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
    let (from, losses) = text
        .lines()
        .find_map(|l| l.strip_prefix("train_cbr: step losses from step "))
        .and_then(|l| l.split_once(": "))
        .map(|(n, l)| {
            (
                n.parse().unwrap(),
                l.split(' ').map(str::to_string).collect(),
            )
        })
        .unwrap_or_else(|| panic!("no losses line:\n{text}"));
    (hash, from, losses, text)
}

/// `--steps N` in one go against `--steps k --save` then `--resume --steps N` in a new
/// process: every loss of steps k+1..N and the final weights hash must be equal bit for bit
/// (the losses are printed with `{:?}`, which round-trips an f32 exactly).
pub fn resume_is_bit_exact(device: &str, extra: &[&str], dir: &Path) {
    let (n, k) = ("12", "5");
    let ck = dir.join("ck.safetensors");
    let ck = ck.to_str().unwrap();
    let base = [&["--device", device, "--batch", "4"][..], extra].concat();
    let (whole, from, all, _) = run(&[&base[..], &["--steps", n]].concat());
    assert_eq!((from, all.len()), (1, 12));
    // Also saving after steps 2 and 4: saving mid-run must not change the run.
    let (part, _, first, text) = run(&[
        &base[..],
        &["--steps", k, "--save", ck, "--save-every", "2"],
    ]
    .concat());
    assert!(text.contains("checkpoint saved"), "{text}");
    assert_eq!(first[..], all[..5], "the first 5 steps differ");
    let (resumed, from, rest, text) = run(&[&base[..], &["--steps", n, "--resume", ck]].concat());
    assert!(
        text.contains("resumed from") && text.contains("at step 5"),
        "{text}"
    );
    println!("{device}: one go {whole}, after 5 steps {part}, resumed {resumed}");
    println!("{device}: losses of steps 6-12: one go {:?}", &all[5..]);
    println!("{device}: losses of steps 6-12: resumed {rest:?}");
    assert_eq!(from, 6);
    assert_eq!(rest[..], all[5..], "the resumed steps' losses differ");
    assert_eq!(resumed, whole, "the resumed run ends with other weights");
    // The weights moved between step 5 and step 12: the hash sees it.
    assert_ne!(part, whole);
}

#[test]
fn twelve_steps_equal_five_a_checkpoint_and_seven_in_a_new_process() {
    let dir = folder("resume");
    resume_is_bit_exact("cpu", &[], &dir);
    // Saving every 2 steps too: the last save (step 5) is the one that stays.
    let every = dir.join("every.safetensors");
    let (_, _, _, text) = run(&[
        "--device",
        "cpu",
        "--batch",
        "4",
        "--steps",
        "5",
        "--save",
        every.to_str().unwrap(),
        "--save-every",
        "2",
    ]);
    assert!(text.contains("checkpoint saved"), "{text}");
    let cfg = TrainConfig {
        batch: 4,
        ..TrainConfig::default()
    };
    assert_eq!(checkpoint::load(&every, &cfg).unwrap().step, 5);
    // --steps at or below the checkpoint's step is refused, naming both.
    let out = Command::new(train_cbr())
        .args(["--device", "cpu", "--batch", "4", "--steps", "5"])
        .args(["--resume", every.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("step 5") && err.contains("--steps"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn log_dir_writes_a_csv_row_per_step_and_an_svg_chart() {
    let dir = folder("curves");
    let log = dir.join("log");
    let (_, _, _, text) = run(&[
        "--device",
        "cpu",
        "--batch",
        "4",
        "--steps",
        "9",
        "--log-dir",
        log.to_str().unwrap(),
    ]);
    assert!(text.contains("curves in"), "{text}");
    let csv = std::fs::read_to_string(log.join("curves.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "step,loss,accuracy,loss_scale,lr,images_per_sec");
    assert_eq!(lines.len(), 1 + 9, "{csv}");
    for (i, l) in lines[1..].iter().enumerate() {
        let f: Vec<f64> = l.split(',').map(|x| x.parse().unwrap()).collect();
        assert_eq!(f.len(), 6, "{l}");
        assert_eq!(f[0], (i + 1) as f64, "{l}");
        // A loss near ln 8 for 8 classes, the default scale and rate, a positive throughput.
        assert!(f[1] > 0.5 && f[1] < 5.0, "{l}");
        assert!((0.0..=1.0).contains(&f[2]), "{l}");
        assert_eq!((f[3], f[4]), (8192.0, 0.05), "{l}");
        assert!(f[5] > 0.0, "{l}");
    }
    let svg = std::fs::read_to_string(log.join("curves.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Five panels, each its caption and its line (the colored ones: loss red, accuracy
    // blue, loss scale magenta, learning rate green; throughput black, like the axes).
    for caption in [
        "loss",
        "accuracy",
        "loss scale",
        "learning rate",
        "images/s",
    ] {
        assert!(
            svg.contains(&format!("\n{caption}\n</text>")),
            "no `{caption}` caption"
        );
    }
    for color in ["#FF0000", "#0000FF", "#FF00FF", "#00FF00"] {
        let line = format!("stroke=\"{color}\"");
        assert_eq!(svg.matches(&line).count(), 1, "no {color} line");
    }
    assert!(svg.len() > 10_000, "{} bytes", svg.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn cfg() -> TrainConfig {
    TrainConfig {
        steps: 3,
        batch: 4,
        ..TrainConfig::default()
    }
}

/// A checkpoint of 3 steps of [`cfg`], made in this process.
fn good_checkpoint(dir: &Path) -> (PathBuf, cudnn_cbr_trainer::TrainReport) {
    let path = dir.join("good.safetensors");
    let mut t = Trainer::new(&cfg()).unwrap();
    t.save_to(&path, 0).unwrap();
    let r = t.run(100, |_| {}).unwrap();
    (path, r)
}

fn ck_err(e: TrainError) -> CheckpointError {
    match e {
        TrainError::Checkpoint(c) => c,
        other => panic!("not a checkpoint error: {other}"),
    }
}

/// `path`'s tensors and metadata rewritten by `edit` (which may change names, dtypes,
/// shapes, bytes or metadata) into `out`.
fn rewrite(
    path: &Path,
    out: &Path,
    edit: impl FnOnce(
        &mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
        &mut std::collections::HashMap<String, String>,
    ),
) {
    let bytes = std::fs::read(path).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors, &mut meta);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(out, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

/// Sets `name`'s recorded checksum to its bytes' (so that a value check, not the checksum,
/// is what refuses the file).
fn fix_checksum(
    tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)],
    meta: &mut std::collections::HashMap<String, String>,
    name: &str,
) {
    let mut sums: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&meta["checksums"]).unwrap();
    let b = &tensors.iter().find(|t| t.0 == name).unwrap().3;
    sums.insert(
        name.into(),
        format!("{:016x}", checkpoint::checksum(b)).into(),
    );
    meta.insert(
        "checksums".into(),
        serde_json::Value::Object(sums).to_string(),
    );
}

#[test]
fn the_file_holds_torchvision_names_oihw_weights_and_the_metadata() {
    let dir = folder("layout");
    let (path, report) = good_checkpoint(&dir);
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    println!("{} tensors: {names:?}", names.len());
    for n in [
        "conv1.weight",
        "bn1.weight",
        "bn1.bias",
        "bn1.running_mean",
        "bn1.running_var",
        "bn1.num_batches_tracked",
        "layer1.0.conv1.weight",
        "layer1.0.bn2.running_var",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.bias",
        "fc.weight",
        "fc.bias",
        "cbr.momentum.conv1.weight",
        "cbr.momentum.fc.bias",
        SCALARS,
    ] {
        assert!(names.contains(&n), "no {n} in {names:?}");
    }
    // conv1.weight is OIHW: the master copy (KRSC) transposed.
    let t = file.tensor("conv1.weight").unwrap();
    let [k, c, r, s] = t.shape().try_into().unwrap();
    let stored: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let master = report.weights.get("stem.w").unwrap();
    assert_eq!(checkpoint::krsc_to_oihw(master, [k, r, s, c]), stored);
    assert_eq!(
        checkpoint::oihw_to_krsc(&stored, [k, r, s, c]),
        master.to_vec()
    );
    let tracked = file.tensor("bn1.num_batches_tracked").unwrap();
    assert_eq!(tracked.shape(), &[] as &[usize]);
    assert_eq!(tracked.data(), 3i64.to_le_bytes());
    let loaded = checkpoint::load(&path, &cfg()).unwrap();
    println!("metadata: {:?}", loaded.meta);
    assert_eq!(loaded.step, 3);
    for (k, v) in [
        ("format", checkpoint::FORMAT),
        ("version", "1"),
        ("net", "mini"),
        ("batch", "4"),
        ("hw", "16"),
        ("classes", "8"),
        ("seed", "1"),
        ("step", "3"),
        ("data", "synthetic"),
        ("loss_scale", "8192"),
    ] {
        assert_eq!(loaded.meta.get(k), Some(v), "{k}");
    }
    assert_eq!(
        loaded.meta.get("weights_hash"),
        Some(format!("{:016x}", report.weights_hash()).as_str())
    );
    // Loading and saving again gives the same state back, and the same bytes: the header's
    // keys are written in sorted order, not in a hash map's order of the moment.
    let again = dir.join("again.safetensors");
    let routes = loaded.meta.get("routes").expect("routes").to_string();
    checkpoint::save(&again, &cfg(), &loaded.state, 3, &routes).unwrap();
    assert_eq!(
        checkpoint::load(&again, &cfg()).unwrap().state,
        loaded.state
    );
    let original = std::fs::read(&path).unwrap();
    assert!(
        std::fs::read(&again).unwrap() == original,
        "saving the loaded state again changed the file's bytes"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint evaluated without training (`Trainer::load_checkpoint`, then `evaluate`)
/// gives the held-out accuracy its run's summary reported, bit for bit; `resume` still
/// refuses a checkpoint at the run's last step (a group of CPU ranks:
/// tests/train_data_parallel.rs).
#[test]
fn a_checkpoint_evaluates_to_its_runs_held_out_accuracy() {
    let dir = folder("evaluate");
    // Long enough to learn (accuracies well above the 1/8 of chance), with an EMA.
    let cfg = TrainConfig {
        steps: 40,
        batch: 16,
        ema: Some(0.9),
        ..TrainConfig::default()
    };
    let path = dir.join("ck.safetensors");
    let (report, e, untrained) = common::evaluated_checkpoint(&cfg, &path);
    assert_eq!(e.held_out_accuracy, report.held_out_accuracy);
    assert_eq!(e.held_out_ema_accuracy, report.held_out_ema_accuracy);
    assert!(e.held_out_accuracy > 0.25, "{e:?}");
    assert_ne!(e, untrained, "the checkpoint was not loaded");
    assert_eq!(e.test_set, None, "the synthetic data has no test set");
    let e = Trainer::new(&cfg).unwrap().resume(&path).unwrap_err();
    assert!(matches!(e, TrainError::Config(_)), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_checkpoints_are_typed_errors_naming_what_is_wrong() {
    let dir = folder("bad");
    let (good, _) = good_checkpoint(&dir);
    let bad = dir.join("bad.safetensors");
    let load = |p: &Path, c: &TrainConfig| ck_err(checkpoint::load(p, c).unwrap_err());
    let bytes = std::fs::read(&good).unwrap();

    // Another network: a wider mini net.
    let wide = TrainConfig { width: 8, ..cfg() };
    let e = load(&good, &wide);
    assert!(
        matches!(&e, CheckpointError::OtherRun { field, .. } if field == "width"),
        "{e}"
    );
    // Another batch (the data position means other images).
    let e = load(&good, &TrainConfig { batch: 8, ..cfg() });
    assert!(
        matches!(&e, CheckpointError::OtherRun { field, .. } if field == "batch"),
        "{e}"
    );

    // Truncated.
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(&bad, &cfg());
    assert!(matches!(e, CheckpointError::Format { .. }), "{e}");
    std::fs::write(&bad, &bytes[..5]).unwrap();
    let e = load(&bad, &cfg());
    assert!(matches!(e, CheckpointError::Format { .. }), "{e}");

    // One flipped bit in the last tensor's bytes: its checksum names it.
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 1;
    std::fs::write(&bad, &flipped).unwrap();
    let e = load(&bad, &cfg());
    assert!(matches!(e, CheckpointError::Checksum { .. }), "{e}");
    println!("flipped byte: {e}");

    // A wrong dtype and a wrong shape, named.
    rewrite(&good, &bad, |t, _| {
        let w = t
            .iter_mut()
            .find(|t| t.0 == "layer1.0.conv2.weight")
            .unwrap();
        w.1 = safetensors::Dtype::I32;
    });
    let e = load(&bad, &cfg());
    assert!(
        matches!(&e, CheckpointError::Dtype { tensor, .. } if tensor == "layer1.0.conv2.weight"),
        "{e}"
    );
    rewrite(&good, &bad, |t, _| {
        let w = t.iter_mut().find(|t| t.0 == "fc.weight").unwrap();
        w.2.reverse();
    });
    let e = load(&bad, &cfg());
    assert!(
        matches!(&e, CheckpointError::Shape { tensor, .. } if tensor == "fc.weight"),
        "{e}"
    );
    // A missing and an unexpected tensor.
    rewrite(&good, &bad, |t, _| t.retain(|t| t.0 != "bn1.running_var"));
    let e = load(&bad, &cfg());
    assert!(
        matches!(&e, CheckpointError::MissingTensor { tensor } if tensor == "bn1.running_var"),
        "{e}"
    );
    rewrite(&good, &bad, |t, _| {
        t.push(("extra".into(), safetensors::Dtype::U8, vec![1], vec![0]));
    });
    let e = load(&bad, &cfg());
    assert!(matches!(e, CheckpointError::UnexpectedTensor { .. }), "{e}");

    // NaN in a weight and Inf in a momentum, with checksums that match: the value check
    // names them.
    for (name, value) in [
        ("layer1.0.conv1.weight", f32::NAN),
        ("cbr.momentum.bn1.bias", f32::INFINITY),
    ] {
        rewrite(&good, &bad, |t, m| {
            let w = t.iter_mut().find(|t| t.0 == name).unwrap();
            w.3[4..8].copy_from_slice(&value.to_le_bytes());
            fix_checksum(t, m, name);
        });
        let e = load(&bad, &cfg());
        assert!(
            matches!(&e, CheckpointError::NonFinite { tensor, index: 1, .. } if tensor == name),
            "{e}"
        );
    }
    // A loss scale of 0, NaN or -1 in S.
    for scale in [0.0f32, f32::NAN, -1.0] {
        rewrite(&good, &bad, |t, m| {
            let s = t.iter_mut().find(|t| t.0 == SCALARS).unwrap();
            s.3[..4].copy_from_slice(&scale.to_le_bytes());
            fix_checksum(t, m, SCALARS);
        });
        let e = load(&bad, &cfg());
        assert!(
            matches!(&e, CheckpointError::BadValue { tensor, .. } if tensor == SCALARS),
            "{scale}: {e}"
        );
    }
    // Another format version.
    rewrite(&good, &bad, |_, m| {
        m.insert("version".into(), "99".into());
    });
    let e = load(&bad, &cfg());
    assert!(
        matches!(&e, CheckpointError::Metadata { field, .. } if field == "version"),
        "{e}"
    );

    // Not a regular file, and no file.
    let e = load(&dir, &cfg());
    assert!(
        matches!(e, CheckpointError::File { .. }) && e.to_string().contains("folder"),
        "{e}"
    );
    let e = load(&dir.join("absent"), &cfg());
    assert!(matches!(e, CheckpointError::File { .. }), "{e}");
    // Too large for this network: refused before it is read.
    let limit = checkpoint::size_limit(&cfg()).unwrap();
    let f = std::fs::File::create(&bad).unwrap();
    f.set_len(limit + 1).unwrap();
    let e = load(&bad, &cfg());
    assert!(e.to_string().contains("too large"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_save_leaves_the_existing_file_untouched() {
    let dir = folder("failed-save");
    let (good, _) = good_checkpoint(&dir);
    let before = std::fs::read(&good).unwrap();
    let mut state = checkpoint::load(&good, &cfg()).unwrap().state;
    // NaN in the master weights: refused, naming the tensor, before anything is written.
    let w = state.region_mut(cudnn_cbr::amp::plan::Region::W).unwrap();
    for x in w.chunks_exact_mut(4) {
        x.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    let e = ck_err(checkpoint::save(&good, &cfg(), &state, 3, "cpu").unwrap_err());
    assert!(matches!(e, CheckpointError::NonFinite { .. }), "{e}");
    println!("{e}");
    assert_eq!(std::fs::read(&good).unwrap(), before);
    // A folder that cannot hold the temporary file (its "parent" is a regular file).
    let state = checkpoint::load(&good, &cfg()).unwrap().state;
    let e =
        ck_err(checkpoint::save(&good.join("under-a-file"), &cfg(), &state, 3, "cpu").unwrap_err());
    assert!(matches!(e, CheckpointError::Write { .. }), "{e}");
    assert_eq!(std::fs::read(&good).unwrap(), before);
    // A run that is to save there is refused before it trains.
    let mut t = Trainer::new(&cfg()).unwrap();
    let e = ck_err(t.save_to(&good.join("under-a-file"), 0).unwrap_err());
    assert!(matches!(e, CheckpointError::Write { .. }), "{e}");
    // A folder that does not exist yet is made.
    t.save_to(&dir.join("new/ck.safetensors"), 0).unwrap();
    assert!(dir.join("new").is_dir());
    std::fs::remove_dir(dir.join("new")).unwrap();
    // No temporary file is left behind.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("good.safetensors")]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// splitmix64: the fuzz cases' mutations.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The fuzz target over checkpoint files: 600 mutations of a good checkpoint (flipped bits and
/// bytes anywhere, the header's length prefix, truncation, appended bytes, edited or removed
/// metadata fields, JSON spliced into the header) are each loaded in this process. Each must
/// give a typed error or load, never panic, and a load must only ever come from a file whose
/// tensors are intact (an edit that the checks cannot see, such as a digit of the learning
/// rate, which a resumed run takes from its own command line).
#[test]
fn fuzzed_checkpoints_are_typed_errors_or_load_never_a_panic() {
    let dir = folder("fuzz");
    let (path, _) = good_checkpoint(&dir);
    let good = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let good_file = safetensors::SafeTensors::deserialize(&good).unwrap();
    let tensors_of = |bytes: &[u8]| -> Option<Vec<(String, Vec<u8>)>> {
        let f = safetensors::SafeTensors::deserialize(bytes).ok()?;
        let mut v: Vec<_> = f
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.data().to_vec()))
            .collect();
        v.sort();
        Some(v)
    };
    let intact = tensors_of(&good).unwrap();
    assert!(!good_file.names().is_empty());
    let out = dir.join("fuzzed.safetensors");
    let mut state = 0xF0CC_u64;
    let (mut loaded, mut refused) = (0, 0);
    for case in 0..600 {
        let mut bytes = good.clone();
        match case % 6 {
            // A few flipped bits anywhere.
            0 => {
                for _ in 0..=(next(&mut state) % 3) {
                    let at = (next(&mut state) % bytes.len() as u64) as usize;
                    bytes[at] ^= 1 << (next(&mut state) % 8);
                }
            }
            // A byte of the JSON header replaced by a random printable one.
            1 => {
                let at = 8 + (next(&mut state) % header_len as u64) as usize;
                bytes[at] = b' ' + (next(&mut state) % 95) as u8;
            }
            // The length prefix changed.
            2 => {
                let len = next(&mut state) % (2 * good.len() as u64);
                bytes[..8].copy_from_slice(&len.to_le_bytes());
            }
            // Truncated, or bytes appended.
            3 => {
                if next(&mut state).is_multiple_of(2) {
                    bytes.truncate((next(&mut state) % good.len() as u64) as usize);
                } else {
                    let extra = 1 + next(&mut state) % 4096;
                    bytes.extend((0..extra).map(|_| next(&mut state) as u8));
                }
            }
            // A metadata field removed, or set to a random value.
            4 | 5 => {
                let mut meta = safetensors::SafeTensors::read_metadata(&good)
                    .unwrap()
                    .1
                    .metadata()
                    .clone()
                    .unwrap();
                let keys: Vec<String> = meta.keys().cloned().collect();
                let key = &keys[(next(&mut state) % keys.len() as u64) as usize];
                if case % 6 == 4 {
                    meta.remove(key);
                } else {
                    let pick = [
                        "".to_string(),
                        "-1".into(),
                        "18446744073709551616".into(),
                        "NaN".into(),
                        "{\"a\":".into(),
                        format!("{}", next(&mut state)),
                        "x".repeat(1 << 12),
                    ];
                    let v = pick[(next(&mut state) % pick.len() as u64) as usize].clone();
                    meta.insert(key.clone(), v);
                }
                let views: Vec<_> = good_file
                    .tensors()
                    .into_iter()
                    .map(|(n, t)| {
                        let view = safetensors::tensor::TensorView::new(
                            t.dtype(),
                            t.shape().to_vec(),
                            t.data(),
                        )
                        .unwrap();
                        (n, view)
                    })
                    .collect();
                bytes = safetensors::serialize(views, Some(meta)).unwrap();
            }
            _ => unreachable!(),
        }
        std::fs::write(&out, &bytes).unwrap();
        let got = std::panic::catch_unwind(|| checkpoint::load(&out, &cfg()));
        match got {
            Err(_) => panic!("case {case}: loading a fuzzed checkpoint panicked"),
            Ok(Ok(_)) => {
                loaded += 1;
                assert_eq!(
                    tensors_of(&bytes).as_ref(),
                    Some(&intact),
                    "case {case}: a checkpoint with altered tensors loaded"
                );
            }
            Ok(Err(e)) => {
                refused += 1;
                assert!(!e.to_string().is_empty(), "case {case}");
            }
        }
    }
    println!("fuzzed checkpoints: {loaded} loaded, {refused} refused (typed errors), 0 panics");
    assert!(refused > 400, "{refused} of 600 refused");
    std::fs::remove_dir_all(&dir).unwrap();
}
