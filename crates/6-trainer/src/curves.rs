//! Training curves: one [`CurvePoint`] per step ([`crate::TrainReport::curve`]), written as
//! `curves.csv` and drawn as `curves.svg` ([`write()`]; `train_cbr --log-dir DIR`).
//!
//! The chart is drawn with the `plotters` crate's SVG backend: no system fonts or native
//! libraries are needed (text is SVG `<text>`, laid out by plotters' built-in estimate), and
//! any browser or `rsvg-convert` shows it. Five panels share the step axis: loss, batch
//! accuracy, loss scale, learning rate and throughput.

use crate::TrainError;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One training step's numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    /// The step (1-based, counted from the start of training, resumed runs included).
    pub step: usize,
    /// The batch's loss.
    pub loss: f32,
    /// The batch's accuracy (0..=1).
    pub accuracy: f32,
    /// The loss scale after the step.
    pub loss_scale: f32,
    /// The learning rate the step applied.
    pub lr: f32,
    /// Images per second since the start of this run.
    pub images_per_sec: f64,
}

/// The CSV header line [`write()`] puts first.
pub const CSV_HEADER: &str = "step,loss,accuracy,loss_scale,lr,images_per_sec";

/// The CSV text of `points`: [`CSV_HEADER`], then one line per point.
pub fn csv(points: &[CurvePoint]) -> String {
    let mut out = String::with_capacity(48 * (points.len() + 1));
    out.push_str(CSV_HEADER);
    out.push('\n');
    for p in points {
        // (Writing to a String cannot fail.)
        let _ = writeln!(
            out,
            "{},{},{},{},{},{:.3}",
            p.step, p.loss, p.accuracy, p.loss_scale, p.lr, p.images_per_sec
        );
    }
    out
}

/// Writes `dir/curves.csv` and `dir/curves.svg` (making `dir` if needed), each through a
/// temporary file and a rename. Returns their paths.
///
/// # Errors
/// [`TrainError::Curves`] naming the file that cannot be written or drawn.
pub fn write(dir: &Path, points: &[CurvePoint]) -> Result<(PathBuf, PathBuf), TrainError> {
    let err = |path: &Path, e: &dyn std::fmt::Display| TrainError::Curves {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| err(dir, &e))?;
    let csv_path = dir.join("curves.csv");
    crate::checkpoint::write_atomic(&csv_path, csv(points).as_bytes())
        .map_err(|e| err(&csv_path, &e))?;
    let svg_path = dir.join("curves.svg");
    let svg = chart(points).map_err(|e| err(&svg_path, &e))?;
    crate::checkpoint::write_atomic(&svg_path, svg.as_bytes()).map_err(|e| err(&svg_path, &e))?;
    Ok((csv_path, svg_path))
}

/// One series' value at a point.
type Value = fn(&CurvePoint) -> f64;

/// The chart of `points` as SVG text.
///
/// # Errors
/// plotters' drawing error, as text.
pub fn chart(points: &[CurvePoint]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 900)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root
            .titled("cudnn-cbr training curves", ("sans-serif", 24))
            .map_err(|e| e.to_string())?;
        let panels = root.split_evenly((3, 2));
        let series: [(&str, RGBColor, Value); 5] = [
            ("loss", RED, |p| f64::from(p.loss)),
            ("accuracy", BLUE, |p| f64::from(p.accuracy)),
            ("loss scale", MAGENTA, |p| f64::from(p.loss_scale)),
            ("learning rate", GREEN, |p| f64::from(p.lr)),
            ("images/s", BLACK, |p| p.images_per_sec),
        ];
        let first = points.first().map_or(0, |p| p.step) as f64;
        let last = points.last().map_or(1, |p| p.step) as f64;
        let x = first..last.max(first + 1.0);
        for ((name, color, value), area) in series.iter().zip(&panels) {
            let ys: Vec<f64> = points.iter().map(value).filter(|v| v.is_finite()).collect();
            let lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (lo, hi) = if lo.is_finite() && hi.is_finite() {
                // A flat series (a fixed learning rate) still gets a visible band.
                let pad = ((hi - lo) * 0.05).max(hi.abs() * 0.05).max(1e-6);
                (if lo >= 0.0 { 0.0 } else { lo - pad }, hi + pad)
            } else {
                (0.0, 1.0)
            };
            let mut c = ChartBuilder::on(area)
                .caption(*name, ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(x.clone(), lo..hi)
                .map_err(|e| e.to_string())?;
            c.configure_mesh()
                .x_desc("step")
                .x_labels(6)
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_labels(6)
                .draw()
                .map_err(|e| e.to_string())?;
            c.draw_series(LineSeries::new(
                points
                    .iter()
                    .map(|p| (p.step as f64, value(p)))
                    .filter(|(_, v)| v.is_finite()),
                color,
            ))
            .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_has_a_header_and_a_line_per_step() {
        let p = |step| CurvePoint {
            step,
            loss: 2.0 / step as f32,
            accuracy: 0.5,
            loss_scale: 8192.0,
            lr: 0.05,
            images_per_sec: 100.0,
        };
        let text = csv(&[p(1), p(2)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                CSV_HEADER,
                "1,2,0.5,8192,0.05,100.000",
                "2,1,0.5,8192,0.05,100.000"
            ]
        );
        let svg = chart(&[p(1), p(2)]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");
    }
}
