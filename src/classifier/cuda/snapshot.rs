//! [`Snapshot`]: the device state a training step reads and writes, downloaded for tests and
//! checkpoints, and its comparisons (relative L2 per part, counters bit for bit).

use crate::amp::plan::Region;
use crate::netops::head::METRICS_LOG_HEADER;
use crate::runtime::DataType;
use half::f16;

/// Device state that a step reads and writes, downloaded (blocking) for tests and
/// checkpoints: every amp region, each layer's running statistics, the training metrics log
/// ([`super::CudaClassifier::snapshot`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Each region's bytes.
    pub regions: Vec<(Region, Vec<u8>)>,
    /// (buffer, values) for every layer's `running_mean` and `running_var`
    /// (`stem.running_mean`, …).
    pub running: Vec<(String, Vec<f32>)>,
    /// The training metrics log image.
    pub log: Vec<u8>,
}

impl Snapshot {
    /// The largest absolute difference between two snapshots' FP32/FP16 values, region by
    /// region (W, M, G, E, S as FP32; A, G16, E16 as FP16), running statistics and log, and
    /// whether they are identical bit for bit.
    pub fn max_abs_diff(&self, other: &Snapshot) -> (f64, bool) {
        let mut worst = 0f64;
        let mut same = self == other;
        let mut see = |a: f64, b: f64| {
            let d = if a.is_nan() && b.is_nan() {
                0.0
            } else {
                (a - b).abs()
            };
            worst = worst.max(if d.is_nan() { f64::INFINITY } else { d });
        };
        for ((ra, a), (rb, b)) in self.regions.iter().zip(&other.regions) {
            if ra != rb || a.len() != b.len() {
                same = false;
                see(0.0, f64::INFINITY);
                continue;
            }
            if ra.dtype() == Some(DataType::Half) {
                for (x, y) in a.chunks_exact(2).zip(b.chunks_exact(2)) {
                    see(
                        f16::from_le_bytes([x[0], x[1]]).to_f64(),
                        f16::from_le_bytes([y[0], y[1]]).to_f64(),
                    );
                }
            } else {
                for (x, y) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
                    see(
                        f64::from(f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
                        f64::from(f32::from_le_bytes([y[0], y[1], y[2], y[3]])),
                    );
                }
            }
        }
        for ((_, a), (_, b)) in self.running.iter().zip(&other.running) {
            for (x, y) in a.iter().zip(b) {
                see(f64::from(*x), f64::from(*y));
            }
        }
        let (log_a, log_b) = (
            self.log.get(4..).unwrap_or(&[]),
            other.log.get(4..).unwrap_or(&[]),
        );
        for (x, y) in log_a.chunks_exact(4).zip(log_b.chunks_exact(4)) {
            see(
                f64::from(f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
                f64::from(f32::from_le_bytes([y[0], y[1], y[2], y[3]])),
            );
        }
        (worst, same)
    }

    /// Per part, the relative L2 difference ‖a − b‖ / ‖b‖ of the values (`other` is `b`):
    /// each region but S (decoded as FP16 or FP32), each running statistic and the metrics
    /// log's losses (its accuracies: [`Snapshot::accuracy_diff`]); and whether S and the
    /// log's header (the counters) are identical bit for bit. For comparing runs that may differ by reduction order: one FP16 rounding
    /// flip moves a part's relative L2 a little, not by orders of magnitude as a maximum
    /// does.
    pub fn rel_l2_by_part(&self, other: &Snapshot) -> (Vec<(String, f64)>, bool) {
        fn rel(a: &[f64], b: &[f64]) -> f64 {
            let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
            let den: f64 = b.iter().map(|y| y * y).sum();
            if a.len() != b.len() || num.is_nan() {
                f64::INFINITY
            } else if num == 0.0 {
                0.0
            } else {
                (num / den.max(f64::MIN_POSITIVE)).sqrt()
            }
        }
        let f32s = |b: &[u8]| -> Vec<f64> {
            b.chunks_exact(4)
                .map(|x| f64::from(f32::from_le_bytes([x[0], x[1], x[2], x[3]])))
                .collect()
        };
        let f16s = |b: &[u8]| -> Vec<f64> {
            b.chunks_exact(2)
                .map(|x| f16::from_le_bytes([x[0], x[1]]).to_f64())
                .collect()
        };
        let mut parts = Vec::new();
        let mut counters_same =
            self.log.get(..METRICS_LOG_HEADER) == other.log.get(..METRICS_LOG_HEADER);
        for ((ra, a), (rb, b)) in self.regions.iter().zip(&other.regions) {
            if ra != rb {
                parts.push((format!("{ra} vs {rb}"), f64::INFINITY));
            } else if *ra == Region::S {
                counters_same &= a == b;
            } else if ra.dtype() == Some(DataType::Half) {
                parts.push((ra.to_string(), rel(&f16s(a), &f16s(b))));
            } else {
                parts.push((ra.to_string(), rel(&f32s(a), &f32s(b))));
            }
        }
        for ((name, a), (_, b)) in self.running.iter().zip(&other.running) {
            let (a, b): (Vec<f64>, Vec<f64>) = (
                a.iter().map(|&v| f64::from(v)).collect(),
                b.iter().map(|&v| f64::from(v)).collect(),
            );
            parts.push((name.clone(), rel(&a, &b)));
        }
        // Entries are (loss, accuracy) pairs: losses compare by relative L2 like the regions;
        // accuracies move in steps of 1/batch (one argmax), so they come separately.
        let (losses_a, _) = log_entries(&self.log);
        let (losses_b, _) = log_entries(&other.log);
        parts.push(("metrics log loss".into(), rel(&losses_a, &losses_b)));
        (parts, counters_same)
    }

    /// The largest absolute difference between the two metrics logs' accuracy entries (a
    /// fraction of the batch; infinite when the logs differ in length).
    pub fn accuracy_diff(&self, other: &Snapshot) -> f64 {
        let (_, a) = log_entries(&self.log);
        let (_, b) = log_entries(&other.log);
        if a.len() != b.len() {
            return f64::INFINITY;
        }
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }
}

/// A metrics-log image's (losses, accuracies), in entry order.
fn log_entries(log: &[u8]) -> (Vec<f64>, Vec<f64>) {
    let body = log.get(METRICS_LOG_HEADER..).unwrap_or(&[]);
    body.chunks_exact(8)
        .map(|e| {
            let f = |b: &[u8]| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            (f(&e[..4]), f(&e[4..]))
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(w: &[f32], a: &[f32], s: [u8; 20]) -> Snapshot {
        let bytes32 = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bytes16 = |v: &[f32]| {
            v.iter()
                .flat_map(|x| f16::from_f32(*x).to_le_bytes())
                .collect()
        };
        let mut log = vec![0u8; METRICS_LOG_HEADER];
        log[0] = 1;
        log.extend(1.5f32.to_le_bytes());
        log.extend(a[0].to_le_bytes()); // stands in for an accuracy
        Snapshot {
            regions: vec![
                (Region::W, bytes32(w)),
                (Region::A, bytes16(a)),
                (Region::S, s.to_vec()),
            ],
            running: vec![("stem.running_mean".into(), vec![0.5, 0.25])],
            log,
        }
    }

    #[test]
    fn parts_are_compared_by_relative_l2_and_counters_bit_for_bit() {
        let s = [0u8; 20];
        let base = snapshot(&[1.0, 2.0, 2.0], &[0.5, 0.25], s);
        let (parts, counters) = base.rel_l2_by_part(&base);
        assert!(counters);
        assert!(parts.iter().all(|(_, r)| *r == 0.0), "{parts:?}");
        let names: Vec<&str> = parts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["W", "A", "stem.running_mean", "metrics log loss"]);
        assert_eq!(base.accuracy_diff(&base), 0.0);

        // W off by 0.03 in one element: ‖Δ‖ / ‖W‖ = 0.03 / 3 = 1e-2; A untouched.
        let moved = snapshot(&[1.0, 2.03, 2.0], &[0.5, 0.25], s);
        let (parts, counters) = moved.rel_l2_by_part(&base);
        assert!(counters);
        assert!((parts[0].1 - 1e-2).abs() < 1e-6, "{parts:?}");
        assert_eq!(parts[1].1, 0.0);
        // The accuracy slot 0.5 → 0.5625 (one more of 16 right) shows in accuracy_diff only.
        let flipped = snapshot(&[1.0, 2.0, 2.0], &[0.5625, 0.25], s);
        assert!((flipped.accuracy_diff(&base) - 0.0625).abs() < 1e-9);
        assert!(flipped.rel_l2_by_part(&base).0[2..]
            .iter()
            .all(|(_, r)| *r == 0.0));

        // One counter in S differs: not a matter of tolerance.
        let mut s2 = s;
        s2[12] = 1;
        let (_, counters) = snapshot(&[1.0, 2.0, 2.0], &[0.5, 0.25], s2).rel_l2_by_part(&base);
        assert!(!counters);
    }
}
