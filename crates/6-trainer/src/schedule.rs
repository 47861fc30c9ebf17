//! The learning-rate schedule over a run's optimizer steps ([`LrSchedule`], with a linear
//! warmup): the rate of step `i` is a pure function of `i` and the configuration, computed on
//! the host and written into the amp step's S before the step (`AmpStep::set_lr`: a few bytes
//! copied in stream order, no wait), so captured CUDA graphs follow it, every executor and
//! rank uses the same rate, and a resumed run continues the schedule where it stopped.

use std::str::FromStr;

/// How the learning rate follows the optimizer steps after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LrSchedule {
    /// The configured rate throughout.
    #[default]
    Constant,
    /// Half a cosine from the configured rate down to 0 over the steps after the warmup
    /// (PyTorch's `CosineAnnealingLR` with `T_max` those steps and `eta_min` 0).
    Cosine,
}

impl LrSchedule {
    /// The lower-case name (`constant`, `cosine`).
    pub fn name(self) -> &'static str {
        match self {
            LrSchedule::Constant => "constant",
            LrSchedule::Cosine => "cosine",
        }
    }
}

impl FromStr for LrSchedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(LrSchedule::Constant),
            "cosine" => Ok(LrSchedule::Cosine),
            other => Err(format!(
                "the learning-rate schedule must be constant or cosine, got `{other}`"
            )),
        }
    }
}

impl std::fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The learning rate of optimizer step `step` (0-based, counted from the start of training)
/// of a run of `steps` steps at base rate `lr`: during the first `warmup` steps
/// `lr · (step + 1) / warmup`; after them `lr` ([`LrSchedule::Constant`]) or
/// `lr · (1 + cos(π · (step − warmup) / (steps − warmup))) / 2` ([`LrSchedule::Cosine`]).
/// Computed in f64, rounded once to f32.
pub fn lr_at(lr: f32, schedule: LrSchedule, warmup: usize, steps: usize, step: usize) -> f32 {
    let base = f64::from(lr);
    let rate = if step < warmup {
        base * (step + 1) as f64 / warmup as f64
    } else {
        match schedule {
            LrSchedule::Constant => base,
            LrSchedule::Cosine => {
                let t = (step - warmup) as f64 / steps.saturating_sub(warmup).max(1) as f64;
                base * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    };
    rate as f32
}

#[cfg(test)]
mod tests {
    use super::{lr_at, LrSchedule};

    #[test]
    fn the_rates_are_the_formulas_written_out() {
        use LrSchedule::{Constant, Cosine};
        // Warmup of 4 steps at 0.1: 0.025, 0.05, 0.075, then 0.1.
        for (step, want) in [(0, 0.025f32), (1, 0.05), (2, 0.075), (3, 0.1), (9, 0.1)] {
            assert_eq!(lr_at(0.1, Constant, 4, 10, step), want, "step {step}");
        }
        // Cosine over the 8 steps after 2 of warmup: 1 at their start, 1/2 halfway (step 6),
        // (1 + cos(3π/4)) / 2 = 0.1464… three quarters in (step 8), never 0 inside the run.
        assert_eq!(lr_at(1.0, Cosine, 2, 10, 2), 1.0);
        assert!((lr_at(1.0, Cosine, 2, 10, 6) - 0.5).abs() < 1e-7);
        let q = (1.0 + (3.0 * std::f64::consts::FRAC_PI_4).cos()) / 2.0;
        assert!((f64::from(lr_at(1.0, Cosine, 2, 10, 8)) - q).abs() < 1e-7);
        assert!(lr_at(1.0, Cosine, 2, 10, 9) > 0.0);
        // Monotone after the warmup; no warmup starts at the base rate.
        let rates: Vec<f32> = (0..12).map(|s| lr_at(1.0, Cosine, 0, 12, s)).collect();
        assert_eq!(rates[0], 1.0);
        assert!(rates.windows(2).all(|w| w[1] < w[0]), "{rates:?}");
        // A warmup as long as the run never reaches the cosine; no division by zero.
        assert_eq!(lr_at(1.0, Cosine, 5, 5, 4), 1.0);
    }

    #[test]
    fn schedules_parse_and_print() {
        for s in [LrSchedule::Constant, LrSchedule::Cosine] {
            assert_eq!(s.to_string().parse::<LrSchedule>(), Ok(s));
        }
        assert!("linear".parse::<LrSchedule>().is_err());
    }
}
