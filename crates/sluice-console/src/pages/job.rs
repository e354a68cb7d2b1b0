//! A job: status, attempts, its chain of limits with the step it is on and
//! why it waits there, its history, a link to its trace, and cancel.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{html, Markup};
use serde::Deserialize;
use sluice_proto::v1 as pb;

use super::{api_error_page, error_page, respond, LiveFragment};
use crate::actions::done_message;
use crate::html::{duration_text, is_finished, key_link, kind_name, link, notice, status_name, trace_link, when, Page};
use crate::{now_ms, Console};

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct JobQuery {
    pub id: String,
    pub done: String,
}

pub async fn page(
    State(console): State<Arc<Console>>,
    Query(query): Query<JobQuery>,
    fragment: LiveFragment,
) -> Response {
    if query.id.is_empty() {
        return error_page(StatusCode::BAD_REQUEST, "Job", "Name a job id.");
    }
    let title = format!("Job {}", query.id);
    let job = match console.services.get_job(&query.id).await {
        Ok(job) => job,
        Err(error) => return api_error_page(&title, &error, fragment),
    };
    let now = now_ms();
    let mut page = Page::new(title);
    page.refresh_ms = console.refresh_ms();
    page.before = html! {
        p.crumbs {
            "tenant " a href=(link("/keys", &[("tenant", &job.tenant)])) { (job.tenant) }
            " · task group " (job.task_group)
            @if let Some(trace) = trace_link(&console.config.console.trace_url_template, &job.job_id, &job.tenant) {
                " · " a #trace-link href=(trace) rel="noopener noreferrer" target="_blank" { "trace" }
            }
        }
        @if let Some(message) = done_message(&query.done) { (notice(message)) }
    };
    page.live = html! {
        section.summary {
            dl {
                dt { "status" } dd #job-status class=(status_name(job.status)) { (status_name(job.status)) }
                dt { "attempt" } dd { (job.attempt) " of " (job.max_attempts) }
                dt { "priority" } dd { (job.priority) }
                dt { "enqueued" } dd { (when(now, job.enqueued_at_ms)) }
                @if let Some(at) = job.run_at_ms { dt { "runs at" } dd { (when(now, at)) } }
                @if let Some(at) = job.admitted_at_ms { dt { "admitted" } dd { (when(now, at)) } }
                @if !job.claimed_by.is_empty() { dt { "claimed by" } dd { (job.claimed_by) } }
                @if let Some(at) = job.lease_expires_at_ms { dt { "lease expires" } dd { (when(now, at)) } }
                @if let Some(at) = job.finished_at_ms { dt { "finished" } dd { (when(now, at)) } }
                @if !job.last_error.is_empty() { dt { "last error" } dd { (job.last_error) } }
                @if !job.idempotency_key.is_empty() { dt { "idempotency key" } dd { (job.idempotency_key) } }
            }
        }
        section #why {
            h2 { "Why" }
            p #job-reason { (job.reason) }
            @if let Some(waiting) = &job.waiting { @if !waiting.key.is_empty() { (wait_explained(&job, waiting, now)) } }
        }
        (chain_table(&job))
        (history_table(&job, now))
    };
    if !is_finished(job.status) {
        page.after = html! {
            section.actions {
                h2 { "Change" }
                form #cancel-job method="post" action="/actions" {
                    input type="hidden" name="action" value="cancel-job";
                    input type="hidden" name="job_id" value=(job.job_id);
                    label { "Reason " input type="text" name="reason" maxlength="1000" placeholder="optional"; }
                    button type="submit" { "Cancel job…" }
                }
            }
        };
    }
    respond(page, fragment)
}

/// The step it waits on, in words and figures.
fn wait_explained(job: &pb::JobView, waiting: &pb::WaitInfo, now: i64) -> Markup {
    let is_rate = waiting.kind == pb::LimitKind::Rate as i32;
    html! {
        dl #wait {
            dt { "waits on" }
            dd {
                @if is_rate {
                    a href=(link("/rate-limits", &[("tenant", &waiting.tenant), ("window", &waiting.key)])) { (waiting.key) }
                } @else {
                    a href=(key_link(&waiting.tenant, &waiting.key)) { (waiting.key) }
                }
                " (" (kind_name(waiting.kind)) ", step " (job.step + 1) " of " (job.acquisition_order.len()) ")"
            }
            @if !is_rate {
                dt { "holders" } dd #wait-holders { (waiting.holders) " of " (waiting.max) " held" }
                dt { "position" }
                dd #wait-position {
                    (waiting.position + 1) " of " (waiting.waiting) " waiting"
                    " (" (waiting.position) " ahead)"
                }
                @if waiting.paused { dt { "paused" } dd.paused { "the key is paused (override 0)" } }
                @else if waiting.overridden { dt { "override" } dd { "the max is a runtime override" } }
            }
            @if let Some(retry_at) = waiting.retry_at_ms {
                dt { "slot opens" } dd #wait-retry { (when(now, retry_at)) }
            }
            @if waiting.waiting_since_ms > 0 {
                dt { "waiting for" } dd { (duration_text(now - waiting.waiting_since_ms)) }
            }
        }
    }
}

fn chain_table(job: &pb::JobView) -> Markup {
    let step = job.step as usize;
    html! {
        section {
            h2 { "Limits, in acquisition order" }
            table #chain {
                thead { tr { th { "step" } th { "kind" } th { "key" } th { "max" } th { "from" } th { "state" } } }
                tbody {
                    @for (index, chain_step) in job.acquisition_order.iter().enumerate() {
                        @let state = if index < step { "held" } else if index == step && !is_finished(job.status) { "acquiring" } else { "not yet" };
                        tr class=(state) {
                            td { (index + 1) }
                            td { (kind_name(chain_step.kind)) }
                            td {
                                @if chain_step.kind == pb::LimitKind::Rate as i32 {
                                    a href=(link("/rate-limits", &[("tenant", &chain_step.tenant), ("window", &chain_step.key)])) { (chain_step.key) }
                                } @else {
                                    a href=(key_link(&chain_step.tenant, &chain_step.key)) { (chain_step.key) }
                                }
                                @if chain_step.tenant != job.tenant { " (tenant " (chain_step.tenant) ")" }
                            }
                            td {
                                (chain_step.max)
                                @if chain_step.kind == pb::LimitKind::Rate as i32 { " per " (duration_text(chain_step.window_ms)) }
                            }
                            td { (chain_step.origin) }
                            td { (state) }
                        }
                    }
                }
            }
            @if job.listed_limits.len() != job.acquisition_order.len() {
                p.note { "The job lists " (job.listed_limits.len()) " limits; its task group adds the rest." }
            }
        }
    }
}

fn history_table(job: &pb::JobView, now: i64) -> Markup {
    html! {
        section {
            h2 { "History" }
            @if job.history.is_empty() {
                p.empty { "No attempt has ended yet." }
            } @else {
                table #history {
                    thead { tr { th { "attempt" } th { "outcome" } th { "detail" } th { "when" } } }
                    tbody {
                        @for record in &job.history {
                            tr { td { (record.attempt) } td { (record.outcome) } td { (record.detail) } td { (when(now, record.at_ms)) } }
                        }
                    }
                }
            }
        }
    }
}
