//! A tenant's keys, a page at a time from the server (ListKeys page tokens),
//! so a tenant with 100k keys costs one page per view.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::html;
use serde::Deserialize;

use super::{api_error_page, error_page, respond, LiveFragment};
use crate::html::{key_link, kind_name, link, Page};
use crate::Console;

pub const DEFAULT_PAGE_SIZE: u32 = 100;
pub const MAX_PAGE_SIZE: u32 = 1000;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct KeysQuery {
    pub tenant: String,
    pub prefix: String,
    pub page_token: String,
    pub page_size: Option<u32>,
}

pub async fn page(
    State(console): State<Arc<Console>>,
    Query(query): Query<KeysQuery>,
    fragment: LiveFragment,
) -> Response {
    let tenant = query.tenant.trim();
    if tenant.is_empty() {
        return error_page(StatusCode::BAD_REQUEST, "Keys", "Name a tenant.");
    }
    let page_size = query.page_size.unwrap_or(DEFAULT_PAGE_SIZE).clamp(1, MAX_PAGE_SIZE);
    let title = format!("Keys of {tenant}");
    let listed = match console
        .services
        .list_keys(tenant, &query.prefix, page_size, &query.page_token)
        .await
    {
        Ok(listed) => listed,
        Err(error) => return api_error_page(&title, &error, fragment),
    };
    let size_text = page_size.to_string();
    let mut page = Page::new(title);
    page.refresh_ms = console.refresh_ms();
    page.before = html! {
        form.inline method="get" action="/keys" {
            input type="hidden" name="tenant" value=(tenant);
            label { "Keys starting with " input name="prefix" value=(query.prefix); }
            button type="submit" { "Filter" }
        }
        p.crumbs {
            a href=(link("/rate-limits", &[("tenant", tenant)])) { "rate limits of " (tenant) }
        }
    };
    page.live = html! {
        @if listed.keys.is_empty() {
            p.empty { "No key with holders, waiters, an override or floating state." }
        } @else {
            table #keys {
                thead { tr { th { "key" } th { "kind" } th { "holders" } th { "waiting" } th { "override" } th { "floating max" } } }
                tbody {
                    @for summary in &listed.keys {
                        @let key = summary.key.clone().unwrap_or_default().key;
                        tr data-key=(key) {
                            td { a href=(key_link(tenant, &key)) { (key) } }
                            td { (kind_name(summary.kind)) }
                            td { (summary.holders) }
                            td { (summary.waiting) }
                            td { @match summary.override_max { Some(0) => "0 (paused)", Some(max) => (max), None => "—" } }
                            td { @match summary.floating_max { Some(max) => (max), None => "—" } }
                        }
                    }
                }
            }
        }
        p.pager {
            @if !query.page_token.is_empty() {
                a #first-page href=(link("/keys", &[("tenant", tenant), ("prefix", &query.prefix), ("page_size", &size_text)])) { "← first page" }
                " "
            }
            @if !listed.next_page_token.is_empty() {
                a #next-page href=(link("/keys", &[("tenant", tenant), ("prefix", &query.prefix), ("page_size", &size_text), ("page_token", &listed.next_page_token)])) { "next page →" }
            }
        }
    };
    respond(page, fragment)
}
