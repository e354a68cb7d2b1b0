//! Tenants at a glance: per tenant, the keys with the most waiters, their
//! utilisation (holders against max), admitted jobs per second and dead
//! letters per second.
//!
//! Where each figure comes from (docs/console.md says the same):
//! - keys, holders, waiting: `ListKeys` pages of the tenant, at most
//!   `console.overview_scan_keys` keys per refresh;
//! - the top keys' max: `DescribeKey` of each (its effective max);
//! - utilisation: the top keys' holders over the sum of their maxes;
//! - admitted/s: `jobs.admitted.<group>` messages of the tenant over the last
//!   10 s (a job re-sent after `claim_timeout` counts again);
//! - grants/s: the owners' grant watch, over the last 10 s;
//! - dead letters/s: `deadletter` messages naming the tenant, last 60 s.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::response::Response;
use futures::StreamExt;
use maud::{html, Markup};
use serde::Deserialize;

use super::{respond, LiveFragment};
use crate::html::{key_link, link, per_second, Page};
use crate::{lock, now_ms, Console, TenantSummary, TopKey};

/// Keys shown per tenant.
const TOP_KEYS: usize = 5;
/// Tenants summarised on one overview.
const TENANTS_SHOWN: usize = 50;
const SUMMARY_CONCURRENCY: usize = 4;
const SCAN_PAGE: u32 = 1000;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct OverviewQuery {
    /// Extra tenants to show, comma-separated.
    pub tenants: String,
}

pub async fn page(
    State(console): State<Arc<Console>>,
    Query(query): Query<OverviewQuery>,
    fragment: LiveFragment,
) -> Response {
    let mut tenants: Vec<String> = console.config.console.tenants.clone();
    tenants.extend(
        query
            .tenants
            .split(',')
            .map(str::trim)
            .filter(|tenant| !tenant.is_empty())
            .map(str::to_string),
    );
    tenants.extend(lock(&console.activity).tenants_seen());
    tenants.sort();
    tenants.dedup();
    let hidden = tenants.len().saturating_sub(TENANTS_SHOWN);
    tenants.truncate(TENANTS_SHOWN);

    let summaries: Vec<(String, TenantSummary)> = futures::stream::iter(tenants)
        .map(|tenant| {
            let console = console.clone();
            async move {
                let summary = summary(&console, &tenant).await;
                (tenant, summary)
            }
        })
        .buffered(SUMMARY_CONCURRENCY)
        .collect()
        .await;
    let now = now_ms();
    let feeds = {
        let feeds = lock(&console.feeds);
        (feeds.grant_streams, feeds.grant_error.clone(), feeds.kafka.clone())
    };
    let mut page = Page::new("Tenants");
    page.refresh_ms = console.refresh_ms();
    page.before = html! {
        form.inline method="get" action="/keys" {
            label { "Tenant " input name="tenant" required; }
            button type="submit" { "Show its keys" }
        }
    };
    page.live = html! {
        @if summaries.is_empty() {
            p.empty {
                "No tenant yet: configure " code { "console.tenants" } ", or wait for jobs to flow (tenants seen in grants, admitted jobs and dead letters appear here)."
            }
        } @else {
            table #tenants {
                thead { tr { th { "tenant" } th { "keys with most waiters" } th { "utilisation" } th { "admitted" } th { "grants" } th { "dead letters" } } }
                tbody {
                    @for (tenant, summary) in &summaries {
                        @let rates = lock(&console.activity).tenant_rates(tenant, now, 10);
                        @let dead = lock(&console.activity).tenant_rates(tenant, now, 60).dead_letters_per_second;
                        tr data-tenant=(tenant) {
                            td { a href=(link("/keys", &[("tenant", tenant)])) { (tenant) } }
                            td { (top_keys(tenant, summary)) }
                            td.utilisation { (utilisation(summary)) }
                            td.admitted { (per_second(rates.admitted_per_second)) }
                            td { (per_second(rates.grants_per_second)) }
                            td { (per_second(dead)) }
                        }
                    }
                }
            }
            @if hidden > 0 { p.note { (hidden) " more tenants not shown; open one by name above." } }
        }
        p.note.feeds {
            "Grant watch: " (feeds.0) " streams"
            @if let Some(error) = &feeds.1 { " (last problem: " (error) ")" }
            ". Kafka reader: " (feeds.2) "."
        }
    };
    respond(page, fragment)
}

fn top_keys(tenant: &str, summary: &TenantSummary) -> Markup {
    html! {
        @if let Some(error) = &summary.error {
            span.problem { (error) }
        } @else if summary.top_keys.is_empty() {
            span.empty { "no busy key" }
        } @else {
            ol.top-keys {
                @for top in &summary.top_keys {
                    li {
                        a href=(key_link(tenant, &top.key)) { (top.key) }
                        " " span.figures {
                            (top.waiting) " waiting, " (top.holders) "/"
                            @match top.max { Some(max) => (max), None => "?" }
                            @if top.paused { " paused" }
                        }
                    }
                }
            }
            @if summary.scan_truncated {
                span.note { "among the first " (summary.keys_scanned) " keys" }
            }
        }
    }
}

fn utilisation(summary: &TenantSummary) -> Markup {
    let known: Vec<&TopKey> = summary.top_keys.iter().filter(|top| top.max.is_some()).collect();
    let holders: i64 = known.iter().map(|top| i64::from(top.holders)).sum();
    let max: i64 = known.iter().filter_map(|top| top.max).sum();
    html! {
        @if max > 0 {
            meter min="0" max=(max) value=(holders.min(max)) {}
            " " (holders) "/" (max)
        } @else if holders > 0 {
            (holders) " holders (paused)"
        } @else {
            "—"
        }
    }
}

/// The tenant's summary, from the cache when younger than a refresh.
async fn summary(console: &Console, tenant: &str) -> TenantSummary {
    let fresh_for = console.config.console.refresh_interval.0;
    if let Some((at, cached)) = lock(&console.overview_cache).get(tenant) {
        if at.elapsed() < fresh_for {
            return cached.clone();
        }
    }
    let computed = compute_summary(console, tenant).await;
    let mut cache = lock(&console.overview_cache);
    cache.retain(|_, (at, _)| at.elapsed() < fresh_for * 10);
    cache.insert(tenant.to_string(), (Instant::now(), computed.clone()));
    computed
}

async fn compute_summary(console: &Console, tenant: &str) -> TenantSummary {
    let mut summary = TenantSummary::default();
    let mut candidates: Vec<(String, u32, u32)> = Vec::new();
    let mut page_token = String::new();
    let budget = console.config.console.overview_scan_keys;
    loop {
        let page_size = SCAN_PAGE.min(u32::try_from(budget - summary.keys_scanned).unwrap_or(SCAN_PAGE));
        let listed = match console.services.list_keys(tenant, "", page_size, &page_token).await {
            Ok(listed) => listed,
            Err(error) => {
                summary.error = Some(error.to_string());
                return summary;
            }
        };
        summary.keys_scanned += listed.keys.len();
        for key in listed.keys {
            summary.holders += u64::from(key.holders);
            summary.waiting += u64::from(key.waiting);
            if key.holders > 0 || key.waiting > 0 {
                candidates.push((key.key.unwrap_or_default().key, key.waiting, key.holders));
            }
        }
        // Keep the candidates small while scanning.
        if candidates.len() > TOP_KEYS * 20 {
            rank(&mut candidates);
            candidates.truncate(TOP_KEYS);
        }
        if listed.next_page_token.is_empty() {
            break;
        }
        if summary.keys_scanned >= budget {
            summary.scan_truncated = true;
            break;
        }
        page_token = listed.next_page_token;
    }
    rank(&mut candidates);
    candidates.truncate(TOP_KEYS);
    for (key, waiting, holders) in candidates {
        let described = console.services.describe_key(tenant, &key, 1).await;
        let (max, paused) = match &described {
            Ok(state) => (state.effective_max, state.paused),
            Err(_) => (None, false),
        };
        summary.top_keys.push(TopKey {
            key,
            holders,
            waiting,
            max,
            paused,
        });
    }
    summary
}

/// Most waiters first, then most holders, then by key.
fn rank(candidates: &mut [(String, u32, u32)]) {
    candidates.sort_by(|left, right| {
        right
            .1
            .cmp(&left.1)
            .then(right.2.cmp(&left.2))
            .then_with(|| left.0.cmp(&right.0))
    });
}
