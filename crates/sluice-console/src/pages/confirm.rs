//! POST /actions: every change. Without a valid confirmation it shows what
//! would happen and asks; with one it applies the action and goes back to
//! the page it came from.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use maud::html;

use super::{error_page, respond_with, status_of, LiveFragment};
use crate::actions::{apply, authorize, Action, ActionForm, Caller};
use crate::html::{problem, Page};
use crate::Console;

/// A browser names the page a form came from; another site's page is refused.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let host = headers.get(header::HOST).and_then(|host| host.to_str().ok());
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|origin| origin.split_once("://"))
        .map(|(_, rest)| rest.trim_end_matches('/'));
    matches!((origin_host, host), (Some(origin_host), Some(host)) if origin_host.eq_ignore_ascii_case(host))
}

pub async fn submit(
    State(console): State<Arc<Console>>,
    caller: Caller,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    if !same_origin(&headers) {
        return error_page(
            StatusCode::FORBIDDEN,
            "Refused",
            "This change came from another site's page.",
        );
    }
    let action = match Action::from_form(&form) {
        Ok(action) => action,
        Err(message) => return error_page(StatusCode::BAD_REQUEST, "Cannot do that", &message),
    };
    if let Err(forbidden) = authorize(&caller, &action) {
        return error_page(StatusCode::FORBIDDEN, "Not allowed", &forbidden.0);
    }
    if form.confirmed != "yes" {
        return confirmation(&console, &action, None, StatusCode::OK);
    }
    if !console.confirm.confirms(&action, &form.token) {
        return confirmation(
            &console,
            &action,
            Some("That confirmation does not match this action (or the console restarted). Confirm again."),
            StatusCode::FORBIDDEN,
        );
    }
    match apply(&console.services, &action).await {
        Ok(done) => {
            tracing::info!(action = ?action, "console action applied");
            Redirect::to(&format!("{}&done={done}", action.return_to())).into_response()
        }
        Err(error) => {
            tracing::info!(action = ?action, %error, "console action failed");
            confirmation(&console, &action, Some(&error.to_string()), status_of(&error))
        }
    }
}

/// The confirmation step: what will happen, and one button that does it.
fn confirmation(console: &Console, action: &Action, trouble: Option<&str>, status: StatusCode) -> Response {
    let token = console.confirm.token(action);
    let mut page = Page::new("Confirm");
    page.live = html! {
        @if let Some(trouble) = trouble { (problem(trouble)) }
        section.confirm #confirm {
            p.what #confirm-what { (action.describe()) "?" }
            p.note { (action.consequence()) }
            form #confirm-form method="post" action="/actions" {
                @for (name, value) in action.fields() {
                    input type="hidden" name=(name) value=(value);
                }
                input type="hidden" name="token" value=(token);
                button #confirm-button type="submit" name="confirmed" value="yes" { "Yes, do it" }
                " "
                a.cancel href=(action.return_to()) { "No, go back" }
            }
        }
    };
    respond_with(status, page, LiveFragment(false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn only_this_sites_pages_may_post() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&headers), "no Origin header: allowed (the token protects)");
        headers.insert(header::ORIGIN, HeaderValue::from_static("http://127.0.0.1:8080"));
        assert!(same_origin(&headers));
        headers.insert(header::ORIGIN, HeaderValue::from_static("https://evil.example"));
        assert!(!same_origin(&headers));
        headers.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(!same_origin(&headers));
    }
}
