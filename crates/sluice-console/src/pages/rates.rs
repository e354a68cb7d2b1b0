//! Rate limits: a tenant's stored rate limits with their current window use
//! and next free slot, any one window (inline or stored) looked up, and
//! put/delete.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::Response;
use futures::StreamExt;
use maud::{html, Markup};
use serde::Deserialize;
use sluice_proto::v1 as pb;

use super::{respond, LiveFragment};
use crate::actions::done_message;
use crate::html::{duration_text, link, notice, problem, when, Page};
use crate::services::ApiError;
use crate::{lock, now_ms, Console};

const RESOURCES_PER_PAGE: u32 = 50;
const LOOKUP_CONCURRENCY: usize = 8;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RatesQuery {
    pub tenant: String,
    /// A window as jobs show it: `resource:<key>` or `inline:<name>:<unique key>`.
    pub window: String,
    pub name: String,
    pub unique_key: String,
    pub page_token: String,
    pub done: String,
}

/// The window a display key names. An inline name containing ':' is read
/// up to its first ':' (use the name and unique key fields for those).
pub fn window_ref(tenant: &str, window: &str) -> Option<pb::RateKeyRef> {
    let kind = if let Some(resource_key) = window.strip_prefix("resource:") {
        pb::rate_key_ref::Kind::ResourceKey(resource_key.to_string())
    } else if let Some(inline) = window.strip_prefix("inline:") {
        let (name, unique_key) = inline.split_once(':').unwrap_or((inline, ""));
        pb::rate_key_ref::Kind::Inline(pb::InlineKey {
            name: name.to_string(),
            unique_key: unique_key.to_string(),
        })
    } else {
        return None;
    };
    Some(pb::RateKeyRef {
        tenant: tenant.to_string(),
        kind: Some(kind),
    })
}

pub async fn page(
    State(console): State<Arc<Console>>,
    Query(query): Query<RatesQuery>,
    fragment: LiveFragment,
) -> Response {
    let mut page = Page::new("Rate limits");
    page.refresh_ms = console.refresh_ms();
    let tenant = query.tenant.trim();
    page.before = html! {
        @if let Some(message) = done_message(&query.done) { (notice(message)) }
        form.inline method="get" action="/rate-limits" {
            label { "Tenant " input name="tenant" value=(tenant) required; }
            button type="submit" { "Show" }
        }
    };
    if tenant.is_empty() {
        let tenants = known_tenants(&console);
        page.live = html! {
            @if tenants.is_empty() { p.empty { "Name a tenant." } }
            @else { ul.tenants { @for tenant in &tenants { li { a href=(link("/rate-limits", &[("tenant", tenant)])) { (tenant) } } } } }
        };
        return respond(page, fragment);
    }
    let now = now_ms();
    let looked_up = looked_up_key(tenant, &query);
    let window_section = match looked_up {
        Some(key) => {
            let described = console.services.describe_rate_key(key).await;
            Some(window_state(&described, now))
        }
        None => None,
    };
    let resources_section = resources_section(&console, tenant, &query.page_token, now).await;
    page.live = html! {
        @if let Some(section) = window_section { (section) }
        (resources_section)
    };
    page.after = actions(tenant, &query);
    respond(page, fragment)
}

/// The window the query names, by name and unique key or as jobs show it.
fn looked_up_key(tenant: &str, query: &RatesQuery) -> Option<pb::RateKeyRef> {
    if !query.name.is_empty() {
        Some(pb::RateKeyRef {
            tenant: tenant.to_string(),
            kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
                name: query.name.clone(),
                unique_key: query.unique_key.clone(),
            })),
        })
    } else {
        window_ref(tenant, &query.window)
    }
}

/// The tenant's stored rate limits (a page of them), each described by its owner.
async fn resources_section(console: &Arc<Console>, tenant: &str, page_token: &str, now: i64) -> Markup {
    let listed = console
        .services
        .list_rate_limits(tenant, RESOURCES_PER_PAGE, page_token)
        .await;
    match listed {
        Err(error) => problem(&error.to_string()),
        Ok(listed) => {
            let described: Vec<(pb::RateLimitResource, Result<pb::DescribeRateKeyResponse, ApiError>)> =
                futures::stream::iter(listed.resources)
                    .map(|resource| {
                        let console = console.clone();
                        async move {
                            let key = pb::RateKeyRef {
                                tenant: resource.tenant.clone(),
                                kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource.resource_key.clone())),
                            };
                            let described = console.services.describe_rate_key(key).await;
                            (resource, described)
                        }
                    })
                    .buffered(LOOKUP_CONCURRENCY)
                    .collect()
                    .await;
            resources_table(tenant, &described, &listed.next_page_token, now)
        }
    }
}

/// The forms: store a rate limit, look up an inline window.
fn actions(tenant: &str, query: &RatesQuery) -> Markup {
    html! {
        section.actions {
            h2 { "Store a rate limit" }
            p.note { "Creates it, or updates it in place. Confirmed on the next page." }
            form #put-rate-limit method="post" action="/actions" {
                input type="hidden" name="action" value="put-rate-limit";
                input type="hidden" name="tenant" value=(tenant);
                label { "Key " input name="resource_key" required; }
                label { "Max count " input type="number" name="max_count" min="1" required; }
                label { "per (seconds) " input type="number" name="window_seconds" min="1" required; }
                button type="submit" { "Save…" }
            }
            h2 { "Look up an inline window" }
            form.inline method="get" action="/rate-limits" {
                input type="hidden" name="tenant" value=(tenant);
                label { "Name " input name="name" required value=(query.name); }
                label { "Unique key " input name="unique_key" value=(query.unique_key); }
                button type="submit" { "Look up" }
            }
        }
    }
}

fn known_tenants(console: &Console) -> Vec<String> {
    let mut tenants: Vec<String> = console.config.console.tenants.clone();
    tenants.extend(lock(&console.activity).tenants_seen());
    tenants.sort();
    tenants.dedup();
    tenants
}

/// When the next unit frees up. The owner's timer for its head waiter is the
/// exact time; with nobody waiting the API tells only that the window is
/// full, so the page says the bound it knows (within one window).
fn next_free(described: &pb::DescribeRateKeyResponse, stored: Option<&pb::RateLimitResource>, now: i64) -> Markup {
    let limit = if described.limit > 0 {
        described.limit
    } else {
        stored.map_or(0, |resource| resource.max_count)
    };
    let window_ms = if described.window_ms > 0 {
        described.window_ms
    } else {
        stored.map_or(0, |resource| resource.window_seconds.saturating_mul(1000))
    };
    match described.next_slot_at_ms {
        Some(at) => when(now, at),
        None if described.stored_resource_missing => html! { "not throttled" },
        None if limit > 0 && described.used >= limit => {
            html! { "full; a unit frees up within " (duration_text(window_ms)) }
        }
        None => html! { "now" },
    }
}

/// Units used against the limit. A window nothing was granted in yet
/// reports no limit: the stored resource's is the one that will apply.
fn usage(described: &pb::DescribeRateKeyResponse, stored_limit: Option<i64>) -> Markup {
    let limit = if described.limit > 0 {
        described.limit
    } else {
        stored_limit.unwrap_or(0)
    };
    let percent = if limit > 0 {
        (described.used.saturating_mul(100) / limit).clamp(0, 100)
    } else {
        0
    };
    html! {
        meter min="0" max=(limit) value=(described.used) title=(format!("{percent}%")) {}
        " " (described.used) " / " (limit)
    }
}

fn window_state(described: &Result<pb::DescribeRateKeyResponse, ApiError>, now: i64) -> Markup {
    html! {
        section #rate-window {
            h2 { "Window" }
            @match described {
                Err(error) => (problem(&error.to_string())),
                Ok(described) => {
                    dl {
                        dt { "used in the window" } dd #window-used { (usage(described, None)) }
                        @if described.window_ms > 0 { dt { "window" } dd { (duration_text(described.window_ms)) } }
                        dt { "waiting" } dd { (described.waiting) }
                        dt { "next free slot" } dd #window-next { (next_free(described, None, now)) }
                        @if described.stored_resource_missing { dt { "note" } dd { "no stored rate limit of that key: jobs naming it are not throttled" } }
                        dt { "owner" } dd { "partition " (described.partition) }
                    }
                }
            }
        }
    }
}

fn resources_table(
    tenant: &str,
    described: &[(pb::RateLimitResource, Result<pb::DescribeRateKeyResponse, ApiError>)],
    next_page_token: &str,
    now: i64,
) -> Markup {
    html! {
        section {
            h2 { "Stored rate limits of " (tenant) }
            @if described.is_empty() {
                p.empty { "None." }
            } @else {
                table #rate-limits {
                    thead { tr { th { "key" } th { "limit" } th { "used in window" } th { "waiting" } th { "next free slot" } th {} } }
                    tbody {
                        @for (resource, state) in described {
                            tr data-resource-key=(resource.resource_key) {
                                td { a href=(link("/rate-limits", &[("tenant", tenant), ("window", &format!("resource:{}", resource.resource_key))])) { (resource.resource_key) } }
                                td { (resource.max_count) " per " (duration_text(resource.window_seconds.saturating_mul(1000))) }
                                @match state {
                                    Ok(state) => {
                                        td { (usage(state, Some(resource.max_count))) }
                                        td { (state.waiting) }
                                        td { (next_free(state, Some(resource), now)) }
                                    }
                                    Err(error) => { td colspan="3" { (error.message) } }
                                }
                                td {
                                    form method="post" action="/actions" {
                                        input type="hidden" name="action" value="delete-rate-limit";
                                        input type="hidden" name="tenant" value=(tenant);
                                        input type="hidden" name="resource_key" value=(resource.resource_key);
                                        button type="submit" { "Delete…" }
                                    }
                                }
                            }
                        }
                    }
                }
                @if !next_page_token.is_empty() {
                    p.pager { a href=(link("/rate-limits", &[("tenant", tenant), ("page_token", next_page_token)])) { "Next page →" } }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_keys_name_their_window() {
        let resource = window_ref("acme", "resource:stripe").unwrap();
        assert_eq!(
            resource.kind,
            Some(pb::rate_key_ref::Kind::ResourceKey("stripe".to_string()))
        );
        let inline = window_ref("acme", "inline:exports:user-1:x").unwrap();
        assert_eq!(
            inline.kind,
            Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
                name: "exports".to_string(),
                unique_key: "user-1:x".to_string()
            }))
        );
        assert!(window_ref("acme", "other").is_none());
    }
}
