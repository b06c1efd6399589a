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
    let error = |reason: String| ChartError {
        path: path.display().to_string(),
        reason,
    };
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(e.to_string()))?;
    let root = root
        .titled(&curve.title, ("sans-serif", 22))
        .map_err(|e| error(e.to_string()))?;
    let (left, right) = root.split_horizontally(600);
    let r_of = |p: &CurvePoint| (p.x, p.r_ms);
    let n_of = |p: &CurvePoint| (p.x, p.n);
    panel(&left, curve, "R (ms)", r_of).map_err(error)?;
    panel(&right, curve, "N (messages in the system)", n_of).map_err(error)?;
    root.present().map_err(|e| error(e.to_string()))?;
    Ok(())
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
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}
