//! The loss curve of a run: one row per step (and one for the evaluation before the first step),
//! written as `train_log.csv` and drawn as `loss.svg` in every checkpoint, and read back when a
//! run resumes.

use std::fmt::Write as _;

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;

/// The CSV's columns, in order.
pub const HEADER: &str =
    "step,tokens,lr,train_loss,grad_norm,heldout_loss,heldout_ppl,tokens_per_s";

/// One line of the log; a value not measured at that step is `None` (an empty field).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub step: usize,
    pub tokens: u64,
    pub lr: Option<f64>,
    pub train_loss: Option<f64>,
    pub grad_norm: Option<f64>,
    pub heldout_loss: Option<f64>,
    pub heldout_ppl: Option<f64>,
    pub tokens_per_s: Option<f64>,
}

/// The CSV text of `rows` (floats in Rust's shortest form that reads back to the same value).
pub fn to_csv(rows: &[Row]) -> String {
    let mut out = format!("{HEADER}\n");
    let field = |v: Option<f64>| v.map_or(String::new(), |x| x.to_string());
    for r in rows {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{}",
            r.step,
            r.tokens,
            field(r.lr),
            field(r.train_loss),
            field(r.grad_norm),
            field(r.heldout_loss),
            field(r.heldout_ppl),
            field(r.tokens_per_s)
        );
    }
    out
}

/// Reads a CSV written by [`to_csv`]; an error names the line that is not.
pub fn from_csv(text: &str) -> Result<Vec<Row>> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        bail!("the first line is not the header {HEADER}")
    }
    lines
        .enumerate()
        .map(|(i, line)| parse_row(line).with_context(|| format!("line {}: {line:?}", i + 2)))
        .collect()
}

fn parse_row(line: &str) -> Result<Row> {
    let f: Vec<&str> = line.split(',').collect();
    if f.len() != 8 {
        bail!("{} fields instead of 8", f.len())
    }
    let float = |s: &str| -> Result<Option<f64>> {
        Ok(match s {
            "" => None,
            s => Some(s.parse().map_err(|e| anyhow!("{s:?}: {e}"))?),
        })
    };
    Ok(Row {
        step: f[0].parse().map_err(|e| anyhow!("step {:?}: {e}", f[0]))?,
        tokens: f[1]
            .parse()
            .map_err(|e| anyhow!("tokens {:?}: {e}", f[1]))?,
        lr: float(f[2])?,
        train_loss: float(f[3])?,
        grad_norm: float(f[4])?,
        heldout_loss: float(f[5])?,
        heldout_ppl: float(f[6])?,
        tokens_per_s: float(f[7])?,
    })
}

/// `(step, value)` of the rows that have `value`.
fn series(rows: &[Row], value: impl Fn(&Row) -> Option<f64>) -> Vec<(f64, f64)> {
    rows.iter()
        .filter_map(|r| {
            value(r)
                .filter(|v| v.is_finite())
                .map(|v| (r.step as f64, v))
        })
        .collect()
}

/// The loss curve as an SVG: train and held-out loss above, the learning rate below.
pub fn plot(rows: &[Row], title: &str) -> Result<String> {
    let train = series(rows, |r| r.train_loss);
    let heldout = series(rows, |r| r.heldout_loss);
    let lr = series(rows, |r| r.lr);
    let x_max = rows.iter().map(|r| r.step).max().unwrap_or(0).max(1) as f64;
    let losses = || train.iter().chain(&heldout).map(|p| p.1);
    let (lo, hi) = (
        losses().fold(f64::INFINITY, f64::min),
        losses().fold(0f64, f64::max),
    );
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(0.05);
    let lr_max = lr.iter().map(|p| p.1).fold(0f64, f64::max).max(1e-12) * 1.05;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(460);
        let mut chart = ChartBuilder::on(&top)
            .caption(title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))?;
        chart
            .configure_mesh()
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_desc("cross-entropy (nats/token)")
            .draw()?;
        chart
            .draw_series(LineSeries::new(train, &BLUE))?
            .label("train")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        let red = RED.stroke_width(2);
        chart
            .draw_series(LineSeries::new(heldout.clone(), red))?
            .label("held-out")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red));
        chart.draw_series(heldout.iter().map(|&p| Circle::new(p, 3, RED.filled())))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        let mut lr_chart = ChartBuilder::on(&bottom)
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, 0f64..lr_max)?;
        lr_chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_desc("learning rate")
            .y_label_formatter(&|v| format!("{v:.1e}"))
            .draw()?;
        lr_chart.draw_series(LineSeries::new(lr, &GREEN))?;
        root.present()?;
    }
    Ok(svg)
}
