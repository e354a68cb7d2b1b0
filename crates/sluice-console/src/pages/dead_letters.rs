//! Dead letters: what producers sent that Sluice could not take, counted by
//! reason and class, the newest listed. Read from the `deadletter` topic by
//! the console itself (no API keeps them), bounded in memory.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;
use maud::html;

use super::{respond, LiveFragment};
use crate::html::{when, Page};
use crate::{lock, now_ms, Console};

const RECENT_SHOWN: usize = 100;

pub async fn page(State(console): State<Arc<Console>>, fragment: LiveFragment) -> Response {
    let now = now_ms();
    let (recent, reasons, classes, seen) = {
        let activity = lock(&console.activity);
        (
            activity.recent_dead_letters(RECENT_SHOWN),
            activity.dead_letter_reasons(),
            activity.dead_letter_classes(),
            activity.dead_letters_seen,
        )
    };
    let feed = lock(&console.feeds).kafka.clone();
    let mut page = Page::new("Dead letters");
    page.refresh_ms = console.refresh_ms();
    page.before = html! {
        p.note {
            "From the " code { (console.config.topic(&console.config.topics.deadletter)) } " topic: the last "
            (console.config.console.dead_letters_kept) " when the console started, and every one since. Reader: " (feed) "."
        }
    };
    page.live = html! {
        p #dead-letter-total { (seen) " dead letters seen" }
        section {
            h2 { "By class" }
            @if classes.is_empty() { p.empty { "None." } }
            @else {
                table #classes {
                    thead { tr { th { "class" } th { "count" } } }
                    tbody { @for (class, count) in &classes { tr { td { (class) } td { (count) } } } }
                }
            }
        }
        section {
            h2 { "By reason" }
            @if reasons.is_empty() { p.empty { "None." } }
            @else {
                table #reasons {
                    thead { tr { th { "reason" } th { "count" } } }
                    tbody { @for (reason, count) in &reasons { tr { td.reason { (reason) } td { (count) } } } }
                }
            }
        }
        section {
            h2 { "Recent" }
            @if recent.is_empty() { p.empty { "None." } }
            @else {
                table #recent-dead-letters {
                    thead { tr { th { "when" } th { "class" } th { "tenant" } th { "reason" } th { "source" } th { "payload" } } }
                    tbody {
                        @for letter in &recent {
                            tr {
                                td { (when(now, letter.at_ms)) }
                                td { (letter.class) }
                                td { @match &letter.tenant { Some(tenant) => (tenant), None => "?" } }
                                td.reason { (letter.reason) }
                                td { code { (letter.source) } }
                                td { code.payload { (letter.payload_preview) } }
                            }
                        }
                    }
                }
            }
        }
    };
    respond(page, fragment)
}
