//! Plots of a run, each written as PNG and SVG with plotters: TTFT and ITL CDFs, output
//! throughput over time, a sweep's tokens/s/user against tokens/s, and ratios between two
//! setups across a grid of workloads ([`ratios`]).
//!
//! Text is drawn with DejaVu Sans embedded in the binary (plotters' `ab_glyph` backend), so
//! plots look the same on a machine with no fonts installed.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::Error;
use crate::metrics::SweepPoint;

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
    save_with(dir, name, SIZE, |root| draw(root, c), |root| draw(root, c))
}

/// Write `dir/name.png` and `dir/name.svg` with one drawing function per backend.
fn save_with(
    dir: &Path,
    name: &str,
    size: (u32, u32),
    png_draw: impl FnOnce(DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), String>,
    svg_draw: impl FnOnce(DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String>,
) -> Result<(), Error> {
    font().map_err(|message| Error::Output {
        path: dir.join(name),
        message,
    })?;
    let png = dir.join(format!("{name}.png"));
    png_draw(BitMapBackend::new(&png, size).into_drawing_area()).map_err(|message| {
        Error::Output {
            path: png.clone(),
            message,
        }
    })?;
    let svg = dir.join(format!("{name}.svg"));
    svg_draw(SVGBackend::new(&svg, size).into_drawing_area()).map_err(|message| Error::Output {
        path: svg.clone(),
        message,
    })
}

/// One workload of a grid: its label and the ratios to plot (baseline ÷ candidate, so above
/// 1 means the candidate is better).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RatioCell {
    pub cell: String,
    pub p50: f64,
    pub p99: f64,
}

fn draw_ratios<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    cells: &[RatioCell],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let top = cells
        .iter()
        .flat_map(|c| [c.p50, c.p99])
        .filter(|v| v.is_finite())
        .fold(2.0, f64::max)
        * 1.1;
    let n = cells.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(e)?;
    let label = |x: &f64| {
        let i = x.floor() as usize;
        if (x - x.floor() - 0.5).abs() < 1e-6 && i < cells.len() {
            cells[i].cell.clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&label)
        .x_label_style(("sans-serif", 13))
        .y_desc("round robin ÷ kv (above 1: kv better)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    let bar = |i: usize, v: f64, left: bool, color: RGBColor| {
        let x0 = i as f64 + if left { 0.12 } else { 0.5 };
        Rectangle::new([(x0, 0.0), (x0 + 0.38, v.max(0.0))], color.filled())
    };
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| bar(i, c.p50, true, BLUE)),
        )
        .map_err(e)?
        .label("TTFT p50")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.filled()));
    chart
        .draw_series(
            cells
                .iter()
                .enumerate()
                .map(|(i, c)| bar(i, c.p99, false, RGBColor(240, 150, 40))),
        )
        .map_err(e)?
        .label("TTFT p99")
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 5), (x + 12, y + 5)],
                RGBColor(240, 150, 40).filled(),
            )
        });
    for (level, color) in [(1.0, BLACK), (1.5, RGBColor(0, 150, 0))] {
        chart
            .draw_series(LineSeries::new(
                [(0.0, level), (n as f64, level)],
                color.stroke_width(1),
            ))
            .map_err(e)?
            .label(format!("{level}×"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color));
    }
    legend(&mut chart, 14, None)?;
    root.present().map_err(e)
}

/// The series' legend, on a translucent white box; `position` as plotters places it if none.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    font: u32,
    position: Option<SeriesLabelPosition>,
) -> Result<(), String> {
    let mut labels = chart.configure_series_labels();
    labels
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", font));
    if let Some(p) = position {
        labels.position(p);
    }
    labels.draw().map_err(|e| e.to_string())
}

/// Bars of baseline ÷ candidate TTFT (p50 and p99) per workload cell, with lines at 1× and
/// 1.5×, as `dir/name.png` and `.svg`.
pub fn ratios(dir: &Path, name: &str, title: &str, cells: &[RatioCell]) -> Result<(), Error> {
    // Room for each cell's label under its bars.
    let size = (SIZE.0.max(80 + 165 * cells.len() as u32), SIZE.1);
    save_with(
        dir,
        name,
        size,
        |root| draw_ratios(root, title, cells),
        |root| draw_ratios(root, title, cells),
    )
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

/// A planner run over time: TTFT (p90 per time bin, with the target) above, replicas per
/// scaled node (actual, and desired dashed) below, on one time axis.
pub fn timeline(
    dir: &Path,
    name: &str,
    ttft_p90: &[(f64, f64)],
    ttft_target: Option<f64>,
    replicas: &[crate::planner::PlannerSample],
) -> Result<(), Error> {
    let size = (960, 720);
    save_with(
        dir,
        name,
        size,
        |root| draw_timeline(root, ttft_p90, ttft_target, replicas),
        |root| draw_timeline(root, ttft_p90, ttft_target, replicas),
    )
}

fn draw_timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    ttft: &[(f64, f64)],
    target: Option<f64>,
    replicas: &[crate::planner::PlannerSample],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled("TTFT and replicas over the run", ("sans-serif", 28))
        .map_err(e)?;
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 * 11 / 20);
    let x_max = ttft
        .iter()
        .map(|p| p.0)
        .chain(replicas.iter().map(|s| s.t_s))
        .fold(1.0, f64::max);
    let y_max = ttft.iter().map(|p| p.1).chain(target).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&top)
        .margin(15)
        .x_label_area_size(30)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .y_desc("TTFT p90 (ms)")
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(ttft.iter().copied(), BLUE.stroke_width(2)))
        .map_err(e)?
        .label("TTFT p90 per bin")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if let Some(t) = target {
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, t), (x_max, t)],
                8,
                6,
                RED.stroke_width(2),
            ))
            .map_err(e)?
            .label("target")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    }
    legend(&mut chart, 16, None)?;

    let r_max = replicas
        .iter()
        .map(|s| s.actual.max(s.desired))
        .max()
        .unwrap_or(1);
    let mut chart = ChartBuilder::on(&bottom)
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, 0.0..f64::from(r_max) + 0.5)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("replicas")
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(e)?;
    let mut nodes: Vec<&str> = replicas.iter().map(|s| s.node.as_str()).collect();
    nodes.dedup();
    nodes.sort_unstable();
    nodes.dedup();
    for (i, node) in nodes.iter().enumerate() {
        let colour = Palette99::pick(i + 2).to_rgba();
        // Steps: each count holds until the next sample.
        let steps = |f: fn(&crate::planner::PlannerSample) -> u32| {
            let mut pts = Vec::new();
            let mine = replicas.iter().filter(|s| s.node == *node);
            for s in mine {
                if let Some(&(_, y)) = pts.last() {
                    pts.push((s.t_s, y));
                }
                pts.push((s.t_s, f64::from(f(s))));
            }
            pts
        };
        chart
            .draw_series(LineSeries::new(steps(|s| s.actual), colour.stroke_width(3)))
            .map_err(e)?
            .label(format!("{node} actual"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(3))
            });
        chart
            .draw_series(DashedLineSeries::new(
                steps(|s| s.desired),
                6,
                4,
                colour.mix(0.6).stroke_width(2),
            ))
            .map_err(e)?
            .label(format!("{node} desired"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.mix(0.6).stroke_width(2))
            });
    }
    legend(&mut chart, 16, Some(SeriesLabelPosition::UpperLeft))?;
    root.present().map_err(e)
}
