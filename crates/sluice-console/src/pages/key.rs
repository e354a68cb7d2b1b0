//! A concurrency or floating key: its effective max and where it comes from,
//! holders with their jobs and leases, waiters in grant order, the refresh
//! history of a floating key, a live chart, and the actions on it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use futures::StreamExt;
use maud::{html, Markup};
use serde::Deserialize;
use sluice_proto::v1 as pb;

use super::{api_error_page, error_page, respond, LiveFragment};
use crate::actions::done_message;
use crate::feeds::{record_floating, record_key_state};
use crate::html::{
    clock, duration_text, job_link, key_chart, kind_name, link, notice, per_second, problem, status_name, when, Page,
};
use crate::services::ApiError;
use crate::{lock, now_ms, Console};

/// Waiters listed (DescribeKey's first waiters, in grant order).
pub const WAITERS_SHOWN: u32 = 100;
/// Holders whose jobs are looked up (status, lease).
const HOLDER_JOBS_LOOKED_UP: usize = 50;
const LOOKUP_CONCURRENCY: usize = 8;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct KeyQuery {
    pub tenant: String,
    pub key: String,
    pub done: String,
}

/// The max in force and where it comes from.
pub fn effective_max(state: &pb::KeyState) -> (String, &'static str) {
    if let Some(max) = state.override_max {
        let origin = if max == 0 {
            "runtime override (paused)"
        } else {
            "runtime override"
        };
        return (max.to_string(), origin);
    }
    if let Some(max) = state.floating_max {
        return (max.to_string(), "floating value (recomputed by workers)");
    }
    if let Some(adaptive) = &state.adaptive {
        return (
            adaptive.current_max.to_string(),
            "adaptive value (computed from run times and outcomes)",
        );
    }
    match state.effective_max {
        Some(max) if state.waiting > 0 => (max.to_string(), "job max (carried by the head waiter)"),
        Some(max) => (max.to_string(), "job max (carried by the last holder)"),
        None => ("—".to_string(), "none yet (no holders, no waiters)"),
    }
}

pub async fn page(
    State(console): State<Arc<Console>>,
    Query(query): Query<KeyQuery>,
    fragment: LiveFragment,
) -> Response {
    if query.tenant.is_empty() || query.key.is_empty() {
        return error_page(StatusCode::BAD_REQUEST, "Key", "Name a tenant and a key.");
    }
    let (tenant, key) = (query.tenant.as_str(), query.key.as_str());
    lock(&console.watch).view(tenant, key, Instant::now());
    let title = format!("Key {key}");
    let state = match console.services.describe_key(tenant, key, WAITERS_SHOWN).await {
        Ok(state) => state,
        Err(error) => return api_error_page(&title, &error, fragment),
    };
    record_key_state(&console, tenant, key, &state);
    let floating = if state.kind == pb::LimitKind::Floating as i32 {
        let described = console.services.describe_floating(tenant, key).await;
        if let Ok(Some(floating)) = &described {
            record_floating(&console, tenant, key, floating);
        }
        Some(described)
    } else {
        None
    };
    let holder_jobs = look_up_holder_jobs(&console, &state).await;

    let now = now_ms();
    let window_ms = console.window_ms();
    let first_second = (now - window_ms).div_euclid(1000);
    let (samples, refreshes, grants, grant_rate) = {
        let watch = lock(&console.watch);
        let activity = lock(&console.activity);
        (
            watch.samples(tenant, key),
            watch.refreshes(tenant, key),
            activity.key_grants_per_second(tenant, key, first_second, now.div_euclid(1000) + 1),
            activity.key_grant_rate(tenant, key, now, 10),
        )
    };

    let mut page = Page::new(title);
    page.refresh_ms = console.refresh_ms();
    page.before = html! {
        p.crumbs {
            "tenant " a href=(link("/keys", &[("tenant", tenant)])) { (tenant) }
        }
        @if let Some(message) = done_message(&query.done) { (notice(message)) }
    };
    let (max_text, origin) = effective_max(&state);
    page.live = html! {
        section.summary {
            dl {
                dt { "effective max" } dd #effective-max { (max_text) }
                dt { "comes from" } dd #max-origin { (origin) }
                dt { "holders" } dd #holder-count { (state.holders.len()) " of " (max_text) }
                dt { "waiting" } dd #waiting-count { (state.waiting) }
                @if let Some(oldest) = state.oldest_waiting_since_ms {
                    dt { "oldest wait" } dd { (duration_text(now - oldest)) }
                }
                dt { "kind" } dd { (kind_name(state.kind)) }
                @if state.paused { dt { "state" } dd.paused { "paused" } }
                dt { "grants" } dd { (per_second(grant_rate)) " over the last 10 s" }
                dt { "owner" } dd { "partition " (state.partition) ", epoch " (state.epoch) }
            }
        }
        section {
            h2 { "Recent activity" }
            (key_chart(&samples, &grants, first_second, now, window_ms))
        }
        (holders_table(&state, &holder_jobs, now))
        (waiters_table(&state, now))
        @if let Some(floating) = &floating { (floating_section(floating, &refreshes, now)) }
        @if let Some(adaptive) = &state.adaptive { (adaptive_section(adaptive, now)) }
        @if let Some(shadow) = &state.shadow { (shadow_section(shadow)) }
        @if !state.flows.is_empty() { (flows_table(&state)) }
    };
    page.after = actions(tenant, key, &state);
    respond(page, fragment)
}

async fn look_up_holder_jobs(
    console: &Console,
    state: &pb::KeyState,
) -> HashMap<String, Result<pb::JobView, ApiError>> {
    let job_ids: Vec<String> = state
        .holders
        .iter()
        .filter_map(|holder| holder.ticket.as_ref().map(|ticket| ticket.job_id.clone()))
        .take(HOLDER_JOBS_LOOKED_UP)
        .collect();
    futures::stream::iter(job_ids)
        .map(|job_id| async move {
            let view = console.services.get_job(&job_id).await;
            (job_id, view)
        })
        .buffer_unordered(LOOKUP_CONCURRENCY)
        .collect()
        .await
}

fn holders_table(state: &pb::KeyState, jobs: &HashMap<String, Result<pb::JobView, ApiError>>, now: i64) -> Markup {
    html! {
        section {
            h2 { "Holders (" (state.holders.len()) ")" }
            @if state.holders.is_empty() {
                p.empty { "No job holds this key." }
            } @else {
                table #holders {
                    thead { tr { th { "job" } th { "attempt" } th { "step" } th { "granted" } th { "job status" } th { "lease expires" } th { "reclaimed unless confirmed" } } }
                    tbody {
                        @for holder in &state.holders {
                            @let ticket = holder.ticket.clone().unwrap_or_default();
                            @let job = jobs.get(&ticket.job_id);
                            tr data-job-id=(ticket.job_id) {
                                td { a href=(job_link(&ticket.job_id)) { (ticket.job_id) } }
                                td { (ticket.attempt) }
                                td { (ticket.step) }
                                td { (when(now, holder.granted_at_ms)) }
                                @match job {
                                    Some(Ok(view)) => {
                                        td { (status_name(view.status)) }
                                        td {
                                            @match view.lease_expires_at_ms.or(holder.lease_expires_at_ms) {
                                                Some(at) => (when(now, at)),
                                                None => "not claimed yet",
                                            }
                                        }
                                    }
                                    Some(Err(error)) => { td colspan="2" { (error.message) } }
                                    None => { td colspan="2" { "not looked up" } }
                                }
                                td { (when(now, holder.expires_unless_confirmed_at_ms)) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn waiters_table(state: &pb::KeyState, now: i64) -> Markup {
    html! {
        section {
            h2 { "Waiters (" (state.waiting) ")" }
            @if state.first_waiters.is_empty() {
                p.empty { "Nobody waits." }
            } @else {
                @if state.waiting as usize > state.first_waiters.len() {
                    p.note { "The first " (state.first_waiters.len()) " of " (state.waiting) ", in grant order." }
                } @else {
                    p.note { "In grant order: lower priority number first, then enqueue time." }
                }
                table #waiters {
                    thead { tr { th { "position" } th { "job" } th { "attempt" } th { "priority" } th { "waiting for" } th { "enqueued" } th { "job max" } } }
                    tbody {
                        @for (index, waiter) in state.first_waiters.iter().enumerate() {
                            @let ticket = waiter.ticket.clone().unwrap_or_default();
                            tr data-job-id=(ticket.job_id) {
                                td { (index + 1) }
                                td { a href=(job_link(&ticket.job_id)) { (ticket.job_id) } }
                                td { (ticket.attempt) }
                                td { (waiter.priority) }
                                td { (duration_text(now - waiter.waiting_since_ms)) }
                                td { (clock(waiter.enqueued_at_us / 1000)) }
                                td { @if waiter.job_max > 0 { (waiter.job_max) } @else { "—" } }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// An adaptive key's computed max, settings, last window and last change.
fn adaptive_section(adaptive: &pb::AdaptiveState, now: i64) -> Markup {
    let settings = adaptive.settings.clone().unwrap_or_default();
    html! {
        section #adaptive {
            h2 { "Adaptive max" }
            dl {
                dt { "computed max" } dd #adaptive-max { (adaptive.current_max) @if adaptive.slow_start { " (slow start)" } }
                dt { "bounds" } dd { (settings.min) " to " (settings.max) }
                dt { "target" } dd {
                    @if settings.target_latency_ms == 0 { "no latency target" }
                    @else { "mean run under " (settings.target_latency_ms) " ms" }
                    ", errors under " (format!("{:.0}", settings.max_error_ratio * 100.0)) " %"
                }
                dt { "last window" } dd {
                    @match adaptive.window_mean_run_ms {
                        Some(mean) => {
                            (adaptive.window_samples) " completions, mean run " (format!("{mean:.0}")) " ms, "
                            (format!("{:.0}", adaptive.window_error_ratio * 100.0)) " % failed"
                        }
                        None => "none closed yet",
                    }
                }
                dt { "open window" } dd { (adaptive.open_window_samples) " of " (adaptive.open_window_size) " completions" }
                dt { "last change" } dd #adaptive-change {
                    @match &adaptive.last_change {
                        Some(change) => {
                            (change.from) " → " (change.to) ", " (when(now, change.at_ms)) ": " (change.reason)
                        }
                        None => "none yet",
                    }
                }
                dt { "changes" } dd { (adaptive.changes) }
            }
        }
    }
}

/// What the key's limit would have done in shadow mode.
fn shadow_section(shadow: &pb::ShadowStats) -> Markup {
    html! {
        section #shadow {
            h2 { "Shadow mode" }
            dl {
                dt { "would hold now" } dd { (shadow.would_hold) }
                dt { "would wait now" } dd { (shadow.would_wait) }
                dt { "would-be grants" } dd { (shadow.would_have_waited_count) }
                dt { "longest would-be wait" } dd { (duration_text(shadow.would_have_waited_ms_max)) }
                dt { "grants over the max" } dd #shadow-exceeded { (shadow.would_have_exceeded) }
            }
        }
    }
}

/// The key's flows (fair sharing): the most waiting first, and stored weights.
fn flows_table(state: &pb::KeyState) -> Markup {
    html! {
        section #flows {
            h2 { "Flows (" (state.flows_waiting) " with waiters)" }
            table {
                thead { tr { th { "fairness key" } th { "weight" } th { "waiting" } th { "holders" } } }
                tbody {
                    @for flow in &state.flows {
                        tr {
                            td { @if flow.fairness_key.is_empty() { "(default)" } @else { (flow.fairness_key) } }
                            td { (flow.weight) @if flow.stored_weight.is_some() { " (stored)" } }
                            td { (flow.waiting) }
                            td { (flow.holders) }
                        }
                    }
                }
            }
        }
    }
}

fn floating_section(
    floating: &Result<Option<pb::DescribeFloatingLimitResponse>, ApiError>,
    refreshes: &[crate::watch::RefreshRecord],
    now: i64,
) -> Markup {
    html! {
        section #floating {
            h2 { "Floating refresh" }
            @match floating {
                Err(error) => (problem(&error.to_string())),
                Ok(None) => p.empty { "The refresh-dispatcher has no state for this key yet (no refresh was due)." },
                Ok(Some(state)) => {
                    dl {
                        dt { "current max" } dd { (state.current_max) }
                        dt { "default max" } dd { (state.default_max) }
                        dt { "refresh interval" } dd { (duration_text(i64::try_from(state.refresh_interval_ms).unwrap_or(i64::MAX))) }
                        @if let Some(due) = state.next_refresh_due_at_ms { dt { "next refresh due" } dd { (when(now, due)) } }
                        dt { "retries" } dd { (state.retry_count) }
                        @if !state.last_error.is_empty() { dt { "last error" } dd { (state.last_error) } }
                        @if !state.in_flight_task_id.is_empty() {
                            dt { "task in flight" }
                            dd {
                                (state.in_flight_task_id)
                                @if let Some(deadline) = state.in_flight_deadline_ms { ", deadline " (when(now, deadline)) }
                            }
                        }
                        @if !state.metadata.is_empty() {
                            dt { "metadata" }
                            dd { @for (name, value) in &state.metadata { code { (name) "=" (value) } " " } }
                        }
                    }
                }
            }
            h3 { "Refresh history" }
            @if refreshes.is_empty() {
                p.empty { "No refresh seen yet." }
            } @else {
                p.note { "Refreshes seen while this console watched the key (the dispatcher keeps only the last)." }
                table #refreshes {
                    thead { tr { th { "when" } th { "value" } th { "outcome" } th { "error" } } }
                    tbody {
                        @for refresh in refreshes {
                            tr { td { (when(now, refresh.at_ms)) } td { (refresh.value) } td { (refresh.outcome) } td { (refresh.error) } }
                        }
                    }
                }
            }
        }
    }
}

fn hidden_key(action: &str, tenant: &str, key: &str) -> Markup {
    html! {
        input type="hidden" name="action" value=(action);
        input type="hidden" name="tenant" value=(tenant);
        input type="hidden" name="key" value=(key);
    }
}

fn actions(tenant: &str, key: &str, state: &pb::KeyState) -> Markup {
    html! {
        section.actions #key-actions {
            h2 { "Change" }
            p.note { "Every change is confirmed on the next page before it applies." }
            form #set-override method="post" action="/actions" {
                (hidden_key("set-override", tenant, key))
                label { "Override max " input type="number" name="max" min="0" max="2147483647" required
                    value=[state.override_max]; }
                button type="submit" { "Set override…" }
            }
            form #clear-override method="post" action="/actions" {
                (hidden_key("clear-override", tenant, key))
                button type="submit" disabled[state.override_max.is_none()] { "Clear override…" }
            }
            form #pause method="post" action="/actions" {
                (hidden_key("pause", tenant, key))
                button type="submit" disabled[state.paused] { "Pause…" }
            }
            form #resume method="post" action="/actions" {
                (hidden_key("resume", tenant, key))
                button type="submit" disabled[!state.paused] { "Resume…" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_max_names_its_origin() {
        let mut state = pb::KeyState {
            effective_max: Some(2),
            waiting: 1,
            ..Default::default()
        };
        assert_eq!(
            effective_max(&state),
            ("2".to_string(), "job max (carried by the head waiter)")
        );
        state.waiting = 0;
        assert_eq!(effective_max(&state).1, "job max (carried by the last holder)");
        state.floating_max = Some(6);
        assert_eq!(
            effective_max(&state),
            ("6".to_string(), "floating value (recomputed by workers)")
        );
        state.floating_max = None;
        state.adaptive = Some(pb::AdaptiveState {
            current_max: 9,
            ..Default::default()
        });
        assert_eq!(
            effective_max(&state),
            ("9".to_string(), "adaptive value (computed from run times and outcomes)")
        );
        let page = adaptive_section(state.adaptive.as_ref().unwrap(), 0).into_string();
        assert!(page.contains("none closed yet") && page.contains("none yet"), "{page}");
        state.override_max = Some(0);
        assert_eq!(effective_max(&state), ("0".to_string(), "runtime override (paused)"));
        assert_eq!(effective_max(&pb::KeyState::default()).0, "—");
    }
}
