//! The loss and accuracy curves as an SVG image (plotters' SVG backend: no system fonts needed).

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::EpochMetrics;

/// Errors drawing the plot.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw the plot {path}: {reason}")]
pub struct PlotError {
    path: String,
    reason: String,
}

/// One series: how to read its value, its legend label and its colour.
type Series = (fn(&EpochMetrics) -> f64, &'static str, RGBColor);
/// One panel: where, its title, its y range and its two series.
type Panel<'a, 'b> = (
    &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    &'static str,
    std::ops::Range<f64>,
    [Series; 2],
);

/// Draws two panels side by side — loss (train, eval) and accuracy in % (train, eval) against the
/// epoch — into the SVG file `path`.
pub fn write_svg(path: &Path, history: &[EpochMetrics]) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let root = SVGBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(500);
    // Integer epochs on the x axis, from 0 to one past the last.
    let last = history.last().map_or(1, |m| m.epoch).max(1) as i32;
    let x_range = 0..last + 1;

    let loss_max = history
        .iter()
        .flat_map(|m| [m.train_loss, m.eval_loss])
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let panels: [Panel<'_, '_>; 2] = [
        (
            &left,
            "loss",
            0.0..loss_max,
            [
                (|m| m.train_loss, "train loss", BLUE),
                (|m| m.eval_loss, "eval loss", RED),
            ],
        ),
        (
            &right,
            "accuracy %",
            0.0..100.0,
            [
                (|m| 100.0 * m.train_accuracy, "train accuracy", BLUE),
                (|m| 100.0 * m.eval_accuracy, "eval accuracy", RED),
            ],
        ),
    ];
    for (area, title, y_range, series) in panels {
        let (lo, hi) = (y_range.start, y_range.end);
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(48)
            .build_cartesian_2d(x_range.clone(), y_range)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .x_labels((last as usize + 2).min(12))
            .draw()
            .map_err(|e| err(&e))?;
        for (value, label, color) in series {
            // Non-finite values are left out and the rest kept inside the panel: a value far
            // outside it (a diverged run, or the meaningless numbers of the CUDA driver
            // stand-in) overflowed plotters' pixel arithmetic.
            let points: Vec<(i32, f64)> = history
                .iter()
                .map(|m| (m.epoch as i32, value(m)))
                .filter(|(_, v)| v.is_finite())
                .map(|(e, v)| (e, v.clamp(lo, hi)))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 3, color.filled())),
                )
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_both_panels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("curves.svg");
        let h: Vec<EpochMetrics> = (1..=4)
            .map(|e| EpochMetrics {
                epoch: e,
                train_loss: 2.0 / e as f64,
                train_accuracy: 0.2 * e as f64,
                eval_loss: 2.2 / e as f64,
                eval_accuracy: 0.18 * e as f64,
                samples_per_sec: 100.0,
                seconds: 1.0,
                sync_seconds: 0.0,
                wait_seconds: 0.0,
            })
            .collect();
        write_svg(&path, &h).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..50.min(svg.len())]);
        for label in ["loss", "accuracy %", "train loss", "eval accuracy", "epoch"] {
            assert!(svg.contains(label), "missing {label}");
        }
        assert!(svg.matches("<polyline").count() >= 4);
    }

    /// Values far outside the panels (a diverged run; the CUDA driver stand-in's meaningless
    /// numbers) are drawn at the edge, not an overflow in the plotting library.
    #[test]
    fn wild_values_do_not_break_the_plot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wild.svg");
        let m = |epoch, train_loss: f64, train_accuracy: f64| EpochMetrics {
            epoch,
            train_loss,
            train_accuracy,
            eval_loss: f64::INFINITY,
            eval_accuracy: -1.8e7,
            samples_per_sec: 1.0,
            seconds: 1.0,
            sync_seconds: 0.0,
            wait_seconds: 0.0,
        };
        let h = vec![m(1, -0.0055, 3.6e6), m(2, 1e30, f64::NAN), m(3, 0.5, 0.5)];
        write_svg(&path, &h).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() > 100);
    }

    #[test]
    fn a_single_epoch_still_plots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("one.svg");
        let h = vec![EpochMetrics {
            epoch: 1,
            train_loss: 1.0,
            train_accuracy: 0.5,
            eval_loss: f64::NAN,
            eval_accuracy: 0.4,
            samples_per_sec: 1.0,
            seconds: 1.0,
            sync_seconds: 0.0,
            wait_seconds: 0.0,
        }];
        write_svg(&path, &h).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() > 100);
    }
}
