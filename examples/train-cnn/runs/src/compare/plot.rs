//! `compare.svg`: eval accuracy (mean ± sd as error bars) against the per-rank batch, one line
//! per mode; beside it the train-loss gap to one process in %.

use std::path::Path;

use plotters::prelude::*;

use super::Mode;
use super::report::Report;
use super::stats::PairedDiff;

/// The colour of a mode's line.
fn colour(mode: Mode) -> RGBColor {
    match mode {
        Mode::OneProcess => RGBColor(0, 0, 0),
        Mode::PerRankBn => RGBColor(214, 39, 40),
        Mode::SyncBn => RGBColor(31, 119, 180),
        Mode::SyncBnWire => RGBColor(44, 160, 44),
    }
}

/// One line of a panel: label, colour and `(per-rank batch, mean, sd)` points.
struct Line {
    label: String,
    colour: RGBColor,
    points: Vec<(usize, f64, f64)>,
}

/// Writes the two panels into the SVG file `path`.
pub fn write_svg(path: &Path, report: &Report) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let c = &report.config;
    let accuracy: Vec<Line> = c
        .modes
        .iter()
        .map(|&mode| Line {
            label: mode.label(&c.wire),
            colour: colour(mode),
            points: report
                .cells
                .iter()
                .filter(|cell| cell.mode == mode)
                .map(|cell| {
                    (
                        cell.per_rank_batch,
                        cell.eval_accuracy.mean,
                        cell.eval_accuracy.sd,
                    )
                })
                .collect(),
        })
        .collect();
    let gap_line = |mode: Mode, f: fn(&super::report::Gaps) -> &PairedDiff| Line {
        label: mode.label(&c.wire),
        colour: colour(mode),
        points: report
            .gaps
            .iter()
            .map(|g| (g.per_rank_batch, f(g).mean, f(g).sd))
            .collect(),
    };
    let gaps = vec![
        gap_line(Mode::PerRankBn, |g| &g.per_rank_bn_train_loss_pct),
        gap_line(Mode::SyncBn, |g| &g.sync_bn_train_loss_pct),
    ];

    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "{} ranks, {} seeds, {} epoch(s) of {} images ({})",
        c.ranks,
        c.seeds.len(),
        c.epochs,
        c.train_size,
        c.backend
    );
    let root = root
        .titled(&title, ("sans-serif", 18))
        .map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    panel(
        &left,
        "eval accuracy % (mean ± sd over seeds)",
        "eval accuracy %",
        &accuracy,
        &c.per_rank_batches,
        None,
    )
    .map_err(|e| err(&e))?;
    panel(
        &right,
        "train-loss gap to one process % (mean ± sd)",
        "final train loss vs one process %",
        &gaps,
        &c.per_rank_batches,
        Some(0.0),
    )
    .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// One panel: the lines with error bars against log2(per-rank batch), an optional horizontal
/// reference line.
fn panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    y_label: &str,
    lines: &[Line],
    batches: &[usize],
    reference: Option<f64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let finite = lines
        .iter()
        .flat_map(|l| &l.points)
        .filter(|(_, m, s)| m.is_finite() && s.is_finite());
    let (lo, hi) = finite
        .map(|&(_, m, s)| (m - s, m + s))
        .chain(reference.map(|r| (r, r)))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (l, h)| {
            (a.min(l), b.max(h))
        });
    let (lo, hi) = if lo.is_finite() && hi > lo {
        let pad = 0.08 * (hi - lo);
        (lo - pad, hi + pad)
    } else if lo.is_finite() {
        (lo - 1.0, lo + 1.0)
    } else {
        (0.0, 1.0)
    };
    let x = |b: usize| (b.max(1) as f64).log2();
    let (x_lo, x_hi) = batches
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, z), &b| {
            (a.min(x(b)), z.max(x(b)))
        });
    let (x_lo, x_hi) = if x_lo.is_finite() {
        (x_lo - 0.4, x_hi + 0.4)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_lo..x_hi, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("per-rank batch (log scale)")
        .y_desc(y_label)
        .x_labels(batches.len().max(2) * 2)
        .x_label_formatter(&|v| {
            let b = 2f64.powf(*v);
            if (b - b.round()).abs() < 1e-6 && b.round() >= 1.0 {
                format!("{}", b.round() as u64)
            } else {
                String::new()
            }
        })
        .draw()?;
    if let Some(r) = reference {
        chart.draw_series(LineSeries::new(
            [(x_lo, r), (x_hi, r)],
            ShapeStyle::from(&RGBColor(150, 150, 150)).stroke_width(1),
        ))?;
    }
    for (k, line) in lines.iter().enumerate() {
        // Lines side by side by a little, so that error bars do not hide each other.
        let shift = (k as f64 - (lines.len() as f64 - 1.0) / 2.0) * 0.05;
        let pts: Vec<(f64, f64, f64)> = line
            .points
            .iter()
            .filter(|(_, m, s)| m.is_finite() && s.is_finite())
            .map(|&(b, m, s)| (x(b) + shift, m, s))
            .collect();
        let style = ShapeStyle::from(&line.colour).stroke_width(2);
        chart
            .draw_series(LineSeries::new(pts.iter().map(|&(x, m, _)| (x, m)), style))?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        chart.draw_series(
            pts.iter()
                .map(|&(x, m, s)| ErrorBar::new_vertical(x, m - s, m, m + s, style.filled(), 8)),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}
