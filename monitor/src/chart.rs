//! Little's-law curves as SVG: response time and population against throughput, the measured
//! points of a series of runs beside the MVA prediction and the throughput bound.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// A point of a series: throughput X (msg/s), population N, response time R (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    pub x: f64,
    pub n: f64,
    pub r_ms: f64,
}

/// What the chart shows.
#[derive(Debug, Clone, Default)]
pub struct LittleCurve {
    pub title: String,
    pub measured: Vec<CurvePoint>,
    pub predicted: Vec<CurvePoint>,
    /// The asymptotic throughput bound 1/D_max, msg/s.
    pub x_bound: Option<f64>,
}

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("drawing {path}: {reason}")]
pub struct ChartError {
    path: String,
    reason: String,
}

/// Writes `curve` to `path` as an SVG of two panels: R against X and N against X.
pub fn write_svg(curve: &LittleCurve, path: &Path) -> Result<(), ChartError> {
    let svg = little_svg(curve).map_err(|reason| ChartError {
        path: path.display().to_string(),
        reason,
    })?;
    std::fs::write(path, svg).map_err(|e| ChartError {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// `curve` as an SVG document: R against X and N against X.
pub fn little_svg(curve: &LittleCurve) -> Result<String, String> {
    let mut svg = String::new();
    draw_little(curve, &mut svg)?;
    Ok(svg)
}

fn draw_little(curve: &LittleCurve, svg: &mut String) -> Result<(), String> {
    let error = |reason: String| reason;
    let root = SVGBackend::with_string(svg, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(e.to_string()))?;
    let root = root
        .titled(&curve.title, ("sans-serif", 22))
        .map_err(|e| error(e.to_string()))?;
    let (left, right) = root.split_horizontally(600);
    let r_of = |p: &CurvePoint| (p.x, p.r_ms);
    let n_of = |p: &CurvePoint| (p.x, p.n);
    panel(&left, curve, "R (ms)", r_of)?;
    panel(&right, curve, "N (messages in the system)", n_of)?;
    root.present().map_err(|e| error(e.to_string()))?;
    Ok(())
}

/// Points per line at most: longer series are thinned to every k-th sample.
const MAX_POINTS_PER_LINE: usize = 1500;

/// The execution graph of a run as an SVG document: every station's queue length over time,
/// and above it the run's throughput (messages stored per second, from the store stations'
/// completions; every station's completions when there is no store station).
pub fn timeline_svg(samples: &[crate::Sample]) -> Result<String, String> {
    let mut stations: Vec<&str> = Vec::new();
    let mut lines: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
    for sample in samples {
        let line = lines.entry(sample.station.as_str()).or_default();
        if line.is_empty() {
            stations.push(sample.station.as_str());
        }
        line.push((sample.t_ms / 1000.0, sample.queue_len as f64));
    }
    let throughput = throughput_series(samples);
    let t_end = samples
        .iter()
        .map(|s| s.t_ms / 1000.0)
        .fold(0.0_f64, f64::max)
        .max(1e-3);
    let q_top = lines
        .values()
        .flatten()
        .map(|p| p.1)
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.08;
    let x_top = throughput
        .iter()
        .map(|p| p.1)
        .fold(0.0_f64, f64::max)
        .max(1.0)
        * 1.08;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, 760)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let (top, bottom) = root.split_vertically(300);
        let mut chart = ChartBuilder::on(&top)
            .caption("Throughput (messages/s)", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..t_end, 0.0..x_top)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("t (s)")
            .draw()
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(LineSeries::new(throughput, BLUE.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&bottom)
            .caption("Queue length by station", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..t_end, 0.0..q_top)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("t (s)")
            .y_desc("messages")
            .draw()
            .map_err(|e| e.to_string())?;
        for (index, name) in stations.iter().enumerate() {
            let points = lines.remove(name).unwrap_or_default();
            let step = points.len().div_ceil(MAX_POINTS_PER_LINE).max(1);
            let color = Palette99::pick(index).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.into_iter().step_by(step),
                    color.stroke_width(1),
                ))
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The legend of a chart's labelled series, boxed, at `position`.
fn legend<'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// Messages completed per second over time, in about a hundred windows.
fn throughput_series(samples: &[crate::Sample]) -> Vec<(f64, f64)> {
    let stored = samples.iter().any(|s| s.station.starts_with("store."));
    let mut latest: std::collections::BTreeMap<&str, u64> = Default::default();
    let mut totals: Vec<(f64, u64)> = Vec::new();
    let mut rows: Vec<&crate::Sample> = samples
        .iter()
        .filter(|s| !stored || s.station.starts_with("store."))
        .collect();
    rows.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    for row in rows {
        latest.insert(row.station.as_str(), row.completions);
        let t = row.t_ms / 1000.0;
        let total = latest.values().sum();
        match totals.last_mut() {
            Some(last) if last.0 == t => last.1 = total,
            _ => totals.push((t, total)),
        }
    }
    let (Some(first), Some(last)) = (totals.first(), totals.last()) else {
        return Vec::new();
    };
    let window = ((last.0 - first.0) / 100.0).max(0.05);
    let mut series = Vec::new();
    let mut start = *first;
    for &(t, count) in &totals {
        if t - start.0 >= window {
            series.push((t, (count - start.1) as f64 / (t - start.0)));
            start = (t, count);
        }
    }
    series
}

fn panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    curve: &LittleCurve,
    y_desc: &str,
    y_of: impl Fn(&CurvePoint) -> (f64, f64),
) -> Result<(), String> {
    let measured: Vec<(f64, f64)> = curve.measured.iter().map(&y_of).collect();
    let predicted: Vec<(f64, f64)> = curve.predicted.iter().map(&y_of).collect();
    // The measured points set the scale; a prediction that leaves it is cut at the frame.
    let x_top = measured
        .iter()
        .chain(&predicted)
        .map(|p| p.0)
        .chain(curve.x_bound)
        .fold(0.0_f64, f64::max)
        * 1.08;
    let y_top = measured.iter().map(|p| p.1).fold(0.0_f64, f64::max) * 1.5;
    let predicted: Vec<(f64, f64)> = predicted.into_iter().take_while(|p| p.1 <= y_top).collect();
    let (x_top, y_top) = (x_top.max(1.0), y_top.max(1e-3));
    let mut chart = ChartBuilder::on(area)
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_top, 0.0..y_top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("X (messages/s)")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| e.to_string())?;
    if !predicted.is_empty() {
        chart
            .draw_series(LineSeries::new(predicted, BLUE.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("MVA prediction")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    }
    if let Some(bound) = curve.x_bound {
        chart
            .draw_series(LineSeries::new(
                vec![(bound, 0.0), (bound, y_top)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label("X bound 1/D_max")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.5)));
    }
    chart
        .draw_series(LineSeries::new(measured.clone(), RED.mix(0.6)))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(
            measured
                .iter()
                .map(|&point| Circle::new(point, 5, RED.filled())),
        )
        .map_err(|e| e.to_string())?
        .label("measured")
        .legend(|(x, y)| Circle::new((x + 10, y), 5, RED.filled()));
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    Ok(())
}

/// A line of an [`XyPanel`]: measured series are drawn with markers, modelled ones dashed-free
/// thinner lines of the same colour.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    pub measured: bool,
    /// Series of one colour belong together (e.g. a measurement and its model).
    pub color: usize,
}

/// One panel of an [`xy_svg`] chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct XyPanel {
    pub caption: String,
    pub x_desc: String,
    pub y_desc: String,
    pub series: Vec<Series>,
}

/// Panels side by side, each of lines over a linear x axis from zero: the charts of a node
/// sweep (per-node rate against node count, R against X).
pub fn xy_svg(title: &str, panels: &[XyPanel]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let width = 600 * panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (width, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root
            .titled(title, ("sans-serif", 22))
            .map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, panels.len().max(1)));
        for (panel, area) in panels.iter().zip(&areas) {
            xy_panel(area, panel)?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

fn xy_panel(area: &DrawingArea<SVGBackend<'_>, Shift>, panel: &XyPanel) -> Result<(), String> {
    let all = panel.series.iter().flat_map(|s| s.points.iter());
    let (x_top, y_top) = all.fold((0.0_f64, 0.0_f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
    let (x_top, y_top) = ((x_top * 1.08).max(1.0), (y_top * 1.15).max(1e-3));
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_top, 0.0..y_top)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(panel.x_desc.as_str())
        .y_desc(panel.y_desc.as_str())
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| e.to_string())?;
    for series in &panel.series {
        let color = Palette99::pick(series.color).to_rgba();
        let width = if series.measured { 2 } else { 1 };
        let drawn = chart
            .draw_series(LineSeries::new(
                series.points.clone(),
                color.stroke_width(width),
            ))
            .map_err(|e| e.to_string())?;
        if series.measured {
            drawn
                .label(series.label.as_str())
                .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
            chart
                .draw_series(
                    series
                        .points
                        .iter()
                        .map(|&point| Circle::new(point, 4, color.filled())),
                )
                .map_err(|e| e.to_string())?;
        } else {
            drawn.label(series.label.as_str()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
            chart
                .draw_series(
                    series
                        .points
                        .iter()
                        .map(|&point| Cross::new(point, 4, color.stroke_width(1))),
                )
                .map_err(|e| e.to_string())?;
        }
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    Ok(())
}

/// The charts of a node sweep (`driver sweep --nodes`) from its `sweep.json`: the per-node rate
/// against the node count, and R against X, one colour family per database count, the
/// measured points beside the MVA model on this machine and on machines of their own.
pub fn node_sweep_svg(points: &serde_json::Value) -> Result<String, String> {
    let points = points
        .as_array()
        .ok_or("sweep.json is not a list of levels")?;
    let number = |point: &serde_json::Value, key: &str| point.get(key).and_then(|v| v.as_f64());
    let mut counts: Vec<f64> = points
        .iter()
        .filter_map(|p| number(p, "databases"))
        .collect();
    counts.dedup();
    let mut total = XyPanel {
        caption: "Throughput over node counts".to_owned(),
        x_desc: "engine nodes".to_owned(),
        y_desc: "X (messages/s)".to_owned(),
        series: Vec::new(),
    };
    let mut per_node = XyPanel {
        caption: "Per-node rate".to_owned(),
        x_desc: "engine nodes".to_owned(),
        y_desc: "X per node (messages/s)".to_owned(),
        series: Vec::new(),
    };
    let mut little = XyPanel {
        caption: "Little's law over node counts".to_owned(),
        x_desc: "X (messages/s)".to_owned(),
        y_desc: "R (ms)".to_owned(),
        series: Vec::new(),
    };
    // (label, the X field, the R field) of the measurement and of each model.
    let lines: [(&str, &str, Option<&str>); 5] = [
        ("measured", "X", Some("R_ms")),
        ("model, this machine", "X_mva", Some("R_mva_ms")),
        ("model, nodes on own machines", "X_own", Some("R_own_ms")),
        ("model, every program on own machines", "X_spread", None),
        ("model, capped nodes", "X_capped", None),
    ];
    for (index, &databases) in counts.iter().enumerate() {
        let of: Vec<&serde_json::Value> = points
            .iter()
            .filter(|p| number(p, "databases") == Some(databases))
            .collect();
        for (offset, (what, x_key, r_key)) in lines.iter().enumerate() {
            let label = format!("{databases} DB {what}");
            let (measured, color) = (offset == 0, index * lines.len() + offset);
            let x: Vec<(f64, f64)> = of
                .iter()
                .filter_map(|p| Some((number(p, "nodes")?, number(p, x_key)?)))
                .collect();
            if x.is_empty() {
                // A model the sweep did not run (capped nodes without --node-cpus).
                continue;
            }
            let rate = x
                .iter()
                .map(|&(nodes, x)| (nodes, x / nodes.max(1.0)))
                .collect();
            // The STE's figure 11: what this machine gives, beside the models of this machine
            // (those of other machines' would flatten it).
            if matches!(*x_key, "X" | "X_mva" | "X_capped") {
                total.series.push(Series {
                    label: label.clone(),
                    points: x,
                    measured,
                    color,
                });
            }
            per_node.series.push(Series {
                label: label.clone(),
                points: rate,
                measured,
                color,
            });
            if let Some(r_key) = r_key {
                let curve: Vec<(f64, f64)> = of
                    .iter()
                    .filter_map(|p| Some((number(p, x_key)?, number(p, r_key)?)))
                    .collect();
                little.series.push(Series {
                    label,
                    points: curve,
                    measured,
                    color,
                });
            }
        }
    }
    let first = points.first();
    let compose = first
        .and_then(|p| p.get("platform"))
        .and_then(|v| v.as_str())
        == Some("compose");
    let title = format!(
        "Scale-out: engine nodes {}, {} messages in flight",
        if compose {
            "in docker-compose containers"
        } else {
            "as processes of one machine"
        },
        first.and_then(|p| number(p, "window")).unwrap_or(0.0)
    );
    xy_svg(&title, &[total, per_node, little])
}
