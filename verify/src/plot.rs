//! The run drawn as Jepsen draws one: each answer's latency over time
//! (green a 2xx, orange a refusal, red no answer), the answers per second
//! below, and the fault windows shaded, so that what each fault did to the
//! service shows at a glance.

use std::path::Path;

use plotters::prelude::*;

use crate::history::{Event, FaultWindow};

/// Writes the timeline of `events` and `faults` as an SVG at `path`.
pub fn timeline(
    path: &Path,
    title: &str,
    events: &[Event],
    faults: &[FaultWindow],
) -> Result<(), String> {
    let answers: Vec<&Event> = events
        .iter()
        .filter(|e| e.is_completion() && e.via != "final")
        .collect();
    let end = events.iter().map(|e| e.t).fold(1.0_f64, f64::max);
    let max_latency = answers
        .iter()
        .map(|e| e.latency_ms as f64)
        .fold(100.0_f64, f64::max);
    let root = SVGBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (top, bottom) = root.split_vertically(450);

    let mut latency = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, (1.0..max_latency * 1.2).log_scale())
        .map_err(|e| e.to_string())?;
    latency
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("latency (ms)")
        .draw()
        .map_err(|e| e.to_string())?;
    shade(&mut latency, faults, 1.0, max_latency * 1.2)?;
    // Each window named at its top, staggered so that neighbours do not
    // overwrite each other.
    latency
        .draw_series(faults.iter().enumerate().map(|(n, f)| {
            let y = max_latency * if n % 2 == 0 { 1.1 } else { 0.7 };
            Text::new(
                f.kind.clone(),
                (f.start, y),
                ("sans-serif", 11).into_font().color(&BLACK.mix(0.7)),
            )
        }))
        .map_err(|e| e.to_string())?;
    for (kind, color) in [
        ("ok", GREEN.mix(0.6)),
        ("fail", RGBColor(230, 140, 0).mix(0.7)),
        ("info", RED.mix(0.8)),
    ] {
        latency
            .draw_series(
                answers
                    .iter()
                    .filter(|e| e.kind == kind)
                    .map(|e| Circle::new((e.t, (e.latency_ms as f64).max(1.0)), 2, color.filled())),
            )
            .map_err(|e| e.to_string())?
            .label(match kind {
                "ok" => "2xx",
                "fail" => "refused",
                _ => "no answer",
            })
            .legend(move |(x, y)| Circle::new((x, y), 3, color.filled()));
    }
    latency
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;

    let seconds = end.ceil() as usize + 1;
    let mut per_second = vec![0u32; seconds];
    for e in answers.iter().filter(|e| e.kind == "ok") {
        per_second[e.t as usize] += 1;
    }
    let max_rate = per_second.iter().copied().max().unwrap_or(1).max(1) as f64;
    let mut rate = ChartBuilder::on(&bottom)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..max_rate * 1.2)
        .map_err(|e| e.to_string())?;
    rate.configure_mesh()
        .x_desc("seconds")
        .y_desc("2xx per second")
        .draw()
        .map_err(|e| e.to_string())?;
    shade(&mut rate, faults, 0.0, max_rate * 1.2)?;
    rate.draw_series(LineSeries::new(
        per_second
            .iter()
            .enumerate()
            .map(|(s, n)| (s as f64 + 0.5, *n as f64)),
        BLUE.stroke_width(2),
    ))
    .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// The fault windows, shaded grey, each labelled with its kind.
fn shade<DB: DrawingBackend, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, Y>>,
    faults: &[FaultWindow],
    low: f64,
    high: f64,
) -> Result<(), String>
where
    Y: Ranged<ValueType = f64>,
{
    chart
        .draw_series(faults.iter().map(|f| {
            Rectangle::new(
                [(f.start, low), (f.end.max(f.start + 0.05), high)],
                BLACK.mix(0.08).filled(),
            )
        }))
        .map_err(|e| format!("{e:?}"))?;
    Ok(())
}
