//! `--svg`: latency and bandwidth against message size.

use plotters::prelude::*;

use crate::perf::PerfResult;

type PlotErr = Box<dyn std::error::Error>;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(120, 120, 120),
];

/// One named series of (size, value) points.
struct Series {
    name: String,
    points: Vec<(u64, f64)>,
}

fn series(
    results: &[PerfResult],
    pick: impl Fn(&PerfResult) -> Option<(f64, Option<f64>)>,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    let mut push = |name: String, x: u64, y: f64| match out.iter_mut().find(|s| s.name == name) {
        Some(s) => s.points.push((x, y)),
        None => out.push(Series {
            name,
            points: vec![(x, y)],
        }),
    };
    for r in results {
        if let Some((v, base)) = pick(r) {
            push(format!("{} {}", r.transport, r.op), r.size, v);
            if let Some(b) = base {
                push(format!("raw-tcp {}", r.op), r.size, b);
            }
        }
    }
    out.retain(|s| !s.points.is_empty());
    out
}

fn chart(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    ylabel: &str,
    data: &[Series],
) -> Result<(), PlotErr> {
    let xmax = data
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .max()
        .unwrap_or(8)
        .max(16);
    let ymax = data
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1e-3f64, f64::max);
    let ymin = data
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|v| *v > 0.0)
        .fold(ymax, f64::min);
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (1u64..xmax * 2).log_scale(),
            (ymin / 2.0..ymax * 2.0).log_scale(),
        )?;
    c.configure_mesh()
        .light_line_style(RGBColor(240, 240, 240))
        .x_desc("message size (bytes)")
        .y_desc(ylabel)
        .draw()?;
    for (i, s) in data.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let style = if s.name.starts_with("raw-tcp") {
            ShapeStyle::from(&color).stroke_width(1)
        } else {
            ShapeStyle::from(&color).stroke_width(2)
        };
        c.draw_series(LineSeries::new(s.points.iter().copied(), style))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

/// Draw p50 latency and bandwidth against size into `path`.
pub(crate) fn draw(path: &str, results: &[PerfResult]) -> Result<(), PlotErr> {
    let root = SVGBackend::new(path, (1100, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(550);
    let lat = series(results, |r| {
        r.p50_us
            .map(|v| (v, r.baseline.as_ref().and_then(|b| b.p50_us)))
    });
    let bw = series(results, |r| {
        r.mb_per_s
            .filter(|_| r.op != "cas" && r.op != "faa")
            .map(|v| (v, r.baseline.as_ref().and_then(|b| b.mb_per_s)))
    });
    chart(&left, "p50 latency", "microseconds", &lat)?;
    chart(&right, "bandwidth", "MB/s", &bw)?;
    root.present()?;
    Ok(())
}
