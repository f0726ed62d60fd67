//! Plots of a run, each written as PNG and SVG with plotters: TTFT and ITL CDFs, output
//! throughput over time, and a sweep's tokens/s/user against tokens/s.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (plotters' `ab_glyph` backend), so
//! plots look the same on a machine with no fonts installed.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::Error;
use crate::report::SweepPoint;

/// A line chart: every plot here is one.
struct Chart<'a> {
    title: &'a str,
    x: &'a str,
    y: &'a str,
    line: Vec<(f64, f64)>,
    /// Points drawn as circles with a label beside each (the sweep's concurrency levels).
    labels: Vec<(f64, f64, String)>,
    /// Fixed y range (a CDF's 0..1); else 0..max with headroom.
    y_max: Option<f64>,
}

const SIZE: (u32, u32) = (960, 600);

fn font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| "cannot load the embedded font".to_owned())
    })
    .clone()
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, c: &Chart) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let max = |f: fn(&(f64, f64)) -> f64| {
        let m = c.line.iter().map(f).fold(0.0, f64::max);
        if m > 0.0 { m * 1.05 } else { 1.0 }
    };
    let (x_max, y_max) = (max(|p| p.0), c.y_max.unwrap_or_else(|| max(|p| p.1)));
    let mut chart = ChartBuilder::on(&root)
        .caption(c.title, ("sans-serif", 28))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(c.x)
        .y_desc(c.y)
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            c.line.iter().copied(),
            BLUE.stroke_width(2),
        ))
        .map_err(e)?;
    chart
        .draw_series(c.labels.iter().map(|(x, y, text)| {
            EmptyElement::at((*x, *y))
                + Circle::new((0, 0), 5, BLUE.filled())
                + Text::new(text.clone(), (8, -18), ("sans-serif", 16))
        }))
        .map_err(e)?;
    root.present().map_err(e)
}

/// Write `dir/name.png` and `dir/name.svg`.
fn save(dir: &Path, name: &str, c: &Chart) -> Result<(), Error> {
    font().map_err(|message| Error::Output {
        path: dir.join(name),
        message,
    })?;
    let png = dir.join(format!("{name}.png"));
    draw(BitMapBackend::new(&png, SIZE).into_drawing_area(), c).map_err(|message| {
        Error::Output {
            path: png.clone(),
            message,
        }
    })?;
    let svg = dir.join(format!("{name}.svg"));
    draw(SVGBackend::new(&svg, SIZE).into_drawing_area(), c).map_err(|message| Error::Output {
        path: svg.clone(),
        message,
    })
}

/// The empirical CDF of `values`.
pub fn cdf(dir: &Path, name: &str, title: &str, x: &str, values: &[f64]) -> Result<(), Error> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let line = v
        .iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect();
    save(
        dir,
        name,
        &Chart {
            title,
            x,
            y: "fraction of requests",
            line,
            labels: Vec::new(),
            y_max: Some(1.0),
        },
    )
}

/// Output tokens/s over the run.
pub fn throughput(dir: &Path, name: &str, series: &[(f64, f64)]) -> Result<(), Error> {
    save(
        dir,
        name,
        &Chart {
            title: "Output token throughput",
            x: "time (s)",
            y: "tokens/s",
            line: series.to_vec(),
            labels: Vec::new(),
            y_max: None,
        },
    )
}

/// Tokens/s per user against total tokens/s, one point per concurrency level.
pub fn sweep(dir: &Path, name: &str, points: &[SweepPoint]) -> Result<(), Error> {
    let xy = |p: &SweepPoint| {
        (
            p.output_token_throughput,
            p.output_token_throughput_per_user,
        )
    };
    save(
        dir,
        name,
        &Chart {
            title: "Concurrency sweep",
            x: "output tokens/s (all users)",
            y: "output tokens/s per user",
            line: points.iter().map(xy).collect(),
            labels: points
                .iter()
                .map(|p| {
                    let (x, y) = xy(p);
                    (x, y, format!("c={}", p.concurrency))
                })
                .collect(),
            y_max: None,
        },
    )
}
