//! Page frame, links and the small formatting every page shares. Every
//! string that reaches a page goes through maud, which escapes it: job ids,
//! keys, payloads and reasons are hostile input.

use std::time::{Duration, UNIX_EPOCH};

use maud::{html, Markup, DOCTYPE};
use sluice_proto::v1 as pb;

use crate::watch::Sample;

pub const CSS: &str = include_str!("../assets/console.css");
pub const JS: &str = include_str!("../assets/console.js");

/// A page: a static part, the live part (refreshed in place by the page's
/// script), and a static part after it (forms, so typing is never disturbed).
pub struct Page {
    pub title: String,
    pub before: Markup,
    pub live: Markup,
    pub after: Markup,
    /// How often the live part refreshes; 0: never.
    pub refresh_ms: u64,
}

impl Page {
    pub fn new(title: impl Into<String>) -> Self {
        Page {
            title: title.into(),
            before: html! {},
            live: html! {},
            after: html! {},
            refresh_ms: 0,
        }
    }

    pub fn render(&self) -> Markup {
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    meta name="viewport" content="width=device-width, initial-scale=1";
                    title { (self.title) " · Sluice console" }
                    link rel="stylesheet" href="/assets/console.css";
                    script src="/assets/console.js" defer {}
                }
                body {
                    header.top {
                        a.brand href="/" { "Sluice" }
                        nav {
                            a href="/" { "Tenants" }
                            a href="/rate-limits" { "Rate limits" }
                            a href="/dead-letters" { "Dead letters" }
                        }
                        form.lookup action="/job" method="get" {
                            input type="search" name="id" placeholder="job id" aria-label="job id" required;
                            button type="submit" { "Open job" }
                        }
                        form.lookup action="/key" method="get" {
                            input name="tenant" placeholder="tenant" aria-label="tenant" required;
                            input name="key" placeholder="key" aria-label="key" required;
                            button type="submit" { "Open key" }
                        }
                        span #live-status aria-live="polite" {}
                    }
                    main {
                        h1 { (self.title) }
                        (self.before)
                        div #live data-refresh-ms=(self.refresh_ms) { (self.live) }
                        (self.after)
                    }
                }
            }
        }
    }
}

/// `path?name=value&...`, every value percent-encoded.
pub fn link(path: &str, params: &[(&str, &str)]) -> String {
    let mut url = path.to_string();
    let mut first = true;
    for (name, value) in params {
        url.push(if first { '?' } else { '&' });
        first = false;
        url.push_str(&encode(name));
        url.push('=');
        url.push_str(&encode(value));
    }
    url
}

/// Percent-encoding of everything but RFC 3986's unreserved characters.
pub fn encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

pub fn key_link(tenant: &str, key: &str) -> String {
    link("/key", &[("tenant", tenant), ("key", key)])
}

pub fn job_link(job_id: &str) -> String {
    link("/job", &[("id", job_id)])
}

/// The configured trace URL with `{job_id}` and `{tenant}` filled in.
pub fn trace_link(template: &str, job_id: &str, tenant: &str) -> Option<String> {
    if template.trim().is_empty() {
        return None;
    }
    Some(
        template
            .replace("{job_id}", &encode(job_id))
            .replace("{tenant}", &encode(tenant)),
    )
}

/// A unix-ms time as UTC, to the second.
pub fn clock(at_ms: i64) -> String {
    let Ok(millis) = u64::try_from(at_ms) else {
        return "-".to_string();
    };
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(millis)).to_string()
}

/// "850 ms", "3.2 s", "4 min 10 s", "2 h 5 min".
pub fn duration_text(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else if ms < 3_600_000 && ms % 60_000 < 1000 {
        format!("{} min", ms / 60_000)
    } else if ms < 3_600_000 {
        format!("{} min {} s", ms / 60_000, (ms % 60_000) / 1000)
    } else if ms < 86_400_000 {
        format!("{} h {} min", ms / 3_600_000, (ms % 3_600_000) / 60_000)
    } else {
        format!("{} d {} h", ms / 86_400_000, (ms % 86_400_000) / 3_600_000)
    }
}

/// "3.2 s ago" or "in 4.0 s", against `now_ms`.
pub fn relative(now_ms: i64, at_ms: i64) -> String {
    if at_ms <= now_ms {
        format!("{} ago", duration_text(now_ms - at_ms))
    } else {
        format!("in {}", duration_text(at_ms - now_ms))
    }
}

/// A time with its distance from now, the exact time as a tooltip.
pub fn when(now_ms: i64, at_ms: i64) -> Markup {
    html! { time datetime=(clock(at_ms)) title=(clock(at_ms)) { (relative(now_ms, at_ms)) } }
}

pub fn per_second(rate: f64) -> String {
    format!("{rate:.1}/s")
}

pub fn status_name(status: i32) -> &'static str {
    match pb::JobStatus::try_from(status) {
        Ok(pb::JobStatus::Scheduled) => "scheduled",
        Ok(pb::JobStatus::Waiting) => "waiting",
        Ok(pb::JobStatus::Admitted) => "admitted",
        Ok(pb::JobStatus::Running) => "running",
        Ok(pb::JobStatus::Cancelling) => "cancelling",
        Ok(pb::JobStatus::Succeeded) => "succeeded",
        Ok(pb::JobStatus::Failed) => "failed",
        Ok(pb::JobStatus::Cancelled) => "cancelled",
        _ => "unknown",
    }
}

pub fn is_finished(status: i32) -> bool {
    matches!(
        pb::JobStatus::try_from(status),
        Ok(pb::JobStatus::Succeeded | pb::JobStatus::Failed | pb::JobStatus::Cancelled)
    )
}

pub fn kind_name(kind: i32) -> &'static str {
    match pb::LimitKind::try_from(kind) {
        Ok(pb::LimitKind::Concurrency) => "concurrency",
        Ok(pb::LimitKind::Floating) => "floating",
        Ok(pb::LimitKind::Rate) => "rate",
        Ok(pb::LimitKind::Adaptive) => "adaptive",
        _ => "unknown",
    }
}

pub fn refresh_outcome_name(outcome: pb::RefreshOutcome) -> &'static str {
    match outcome {
        pb::RefreshOutcome::Succeeded => "succeeded",
        pb::RefreshOutcome::Failed => "failed",
        pb::RefreshOutcome::OutOfRange => "out of range",
        pb::RefreshOutcome::TimedOut => "timed out",
        pb::RefreshOutcome::Unspecified => "none yet",
    }
}

/// A message box: `notice` for what was done, `problem` for what failed.
pub fn notice(text: &str) -> Markup {
    html! { p.notice role="status" { (text) } }
}

pub fn problem(text: &str) -> Markup {
    html! { p.problem role="alert" { (text) } }
}

const CHART_WIDTH: f64 = 640.0;
/// The shortest time a chart spans.
const MIN_CHART_SPAN_MS: i64 = 30_000;
const CHART_HEIGHT: f64 = 180.0;
const CHART_LEFT: f64 = 40.0;
const CHART_RIGHT: f64 = 8.0;
const CHART_TOP: f64 = 10.0;
const CHART_BOTTOM: f64 = 22.0;

/// Holders, waiters and grants per second over at most `[now - window, now]`, as an
/// inline SVG drawn on the server (no script needed; the live refresh
/// redraws it).
pub fn key_chart(
    samples: &[Sample],
    grants_per_second: &[u64],
    first_second: i64,
    now_ms: i64,
    window_ms: i64,
) -> Markup {
    let span_ms = chart_span_ms(samples, grants_per_second, first_second, now_ms, window_ms);
    let start_ms = now_ms - span_ms;
    let highest = chart_highest(samples, grants_per_second);
    let plot_width = CHART_WIDTH - CHART_LEFT - CHART_RIGHT;
    let plot_height = CHART_HEIGHT - CHART_TOP - CHART_BOTTOM;
    let x = |at_ms: i64| CHART_LEFT + ((at_ms - start_ms).clamp(0, span_ms) as f64 / span_ms as f64) * plot_width;
    let y = |value: u64| CHART_TOP + plot_height - (value as f64 / highest as f64) * plot_height;
    let line = |values: Vec<(i64, u64)>| -> String {
        values
            .iter()
            .map(|(at_ms, value)| format!("{:.1},{:.1}", x(*at_ms), y(*value)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let visible: Vec<&Sample> = samples.iter().filter(|sample| sample.at_ms >= start_ms).collect();
    let holders = line(
        visible
            .iter()
            .map(|sample| (sample.at_ms, u64::from(sample.holders)))
            .collect(),
    );
    let waiting = line(
        visible
            .iter()
            .map(|sample| (sample.at_ms, u64::from(sample.waiting)))
            .collect(),
    );
    let grants = line(
        grants_per_second
            .iter()
            .enumerate()
            .map(|(index, count)| {
                let second = first_second + i64::try_from(index).unwrap_or(0);
                (second * 1000 + 500, *count)
            })
            .filter(|(at_ms, _)| *at_ms >= start_ms)
            .collect(),
    );
    let bottom = CHART_TOP + plot_height;
    html! {
        figure.chart {
            svg #key-chart viewBox=(format!("0 0 {CHART_WIDTH} {CHART_HEIGHT}")) role="img"
                data-samples=(visible.len())
                aria-label="holders, waiters and grants per second over the last minutes" {
                line.axis x1=(CHART_LEFT) y1=(bottom) x2=(CHART_WIDTH - CHART_RIGHT) y2=(bottom) {}
                line.axis x1=(CHART_LEFT) y1=(CHART_TOP) x2=(CHART_LEFT) y2=(bottom) {}
                text.label x=(CHART_LEFT - 6.0) y=(CHART_TOP + 8.0) text-anchor="end" { (highest) }
                text.label x=(CHART_LEFT - 6.0) y=(bottom) text-anchor="end" { "0" }
                text.label x=(CHART_LEFT) y=(CHART_HEIGHT - 6.0) { "−" (duration_text(span_ms)) }
                text.label x=(CHART_WIDTH - CHART_RIGHT) y=(CHART_HEIGHT - 6.0) text-anchor="end" { "now" }
                polyline.series.grants points=(grants) { title { "grants per second" } }
                polyline.series.waiting points=(waiting) { title { "waiting" } }
                polyline.series.holders points=(holders) { title { "holders" } }
            }
            figcaption {
                span.swatch.holders {} "holders "
                span.swatch.waiting {} "waiting "
                span.swatch.grants {} "grants/s"
                @if visible.is_empty() { " — sampling starts now" }
            }
        }
    }
}

/// How long a chart spans: what there is to show, from the first sample or
/// grant (a key just opened has seconds of data, not minutes), at least
/// 30 s, at most the window.
fn chart_span_ms(samples: &[Sample], grants_per_second: &[u64], first_second: i64, now_ms: i64, window_ms: i64) -> i64 {
    let longest_ms = window_ms.max(1);
    let first_data_ms = samples
        .iter()
        .map(|sample| sample.at_ms)
        .chain(
            grants_per_second
                .iter()
                .position(|count| *count > 0)
                .map(|index| (first_second + i64::try_from(index).unwrap_or(0)) * 1000),
        )
        .min()
        .unwrap_or(now_ms);
    (now_ms - first_data_ms + 1_000).clamp(MIN_CHART_SPAN_MS.min(longest_ms), longest_ms)
}

/// The chart's top value: the highest count shown, at least 1.
fn chart_highest(samples: &[Sample], grants_per_second: &[u64]) -> u64 {
    samples
        .iter()
        .map(|sample| u64::from(sample.holders.max(sample.waiting)))
        .chain(grants_per_second.iter().copied())
        .max()
        .unwrap_or(0)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_encode_every_reserved_character() {
        assert_eq!(
            link("/key", &[("tenant", "a&b"), ("key", "x y/<z>")]),
            "/key?tenant=a%26b&key=x%20y%2F%3Cz%3E"
        );
        assert_eq!(encode("é"), "%C3%A9");
    }

    #[test]
    fn trace_links_fill_the_template_encoded() {
        assert_eq!(trace_link("", "j", "t"), None);
        assert_eq!(
            trace_link("http://ui/search?job={job_id}&t={tenant}", "a b\"", "acme").as_deref(),
            Some("http://ui/search?job=a%20b%22&t=acme")
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(duration_text(850), "850 ms");
        assert_eq!(duration_text(3_200), "3.2 s");
        assert_eq!(duration_text(250_000), "4 min 10 s");
        assert_eq!(duration_text(300_000), "5 min");
        assert_eq!(duration_text(7_500_000), "2 h 5 min");
        assert_eq!(relative(10_000, 7_000), "3.0 s ago");
        assert_eq!(relative(10_000, 14_000), "in 4.0 s");
        assert_eq!(clock(0), "1970-01-01T00:00:00Z");
        assert_eq!(clock(-1), "-");
    }

    #[test]
    fn hostile_text_is_escaped() {
        let mut page = Page::new("<script>alert(1)</script>");
        page.live = html! { p { ("\"><img src=x onerror=alert(1)>") } };
        let rendered = page.render().into_string();
        assert!(!rendered.contains("<script>alert"), "{rendered}");
        assert!(!rendered.contains("<img src=x"), "{rendered}");
        assert!(rendered.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    }

    #[test]
    fn the_chart_draws_each_series_inside_the_frame() {
        let samples = [
            Sample {
                at_ms: 1_000,
                holders: 1,
                waiting: 4,
            },
            Sample {
                at_ms: 2_000,
                holders: 2,
                waiting: 0,
            },
        ];
        let chart = key_chart(&samples, &[0, 3], 0, 2_000, 2_000).into_string();
        assert!(
            chart.contains("−2.0 s"),
            "a window shorter than the shortest span is the span: {chart}"
        );
        assert!(chart.contains("data-samples=\"2\""), "{chart}");
        assert!(
            chart.contains(">4</text>"),
            "the top of the scale is the highest value: {chart}"
        );
        assert_eq!(chart.matches("<polyline").count(), 3);
    }
}
