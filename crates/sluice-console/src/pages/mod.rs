//! One module per page. Each handler asks the services, builds a `Page`, and
//! answers either the whole page or, for the page's script, its live part.

pub mod confirm;
pub mod dead_letters;
pub mod job;
pub mod key;
pub mod keys;
pub mod overview;
pub mod rates;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::html::{problem, Page};
use crate::services::ApiError;

/// The header the page script sends to get only the live part.
pub const FRAGMENT_HEADER: &str = "x-console-fragment";

/// Whether the request wants only the page's live part.
#[derive(Clone, Copy, Debug)]
pub struct LiveFragment(pub bool);

impl<S: Send + Sync> FromRequestParts<S> for LiveFragment {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(LiveFragment(
            parts
                .headers
                .get(FRAGMENT_HEADER)
                .is_some_and(|value| value.as_bytes() == b"live"),
        ))
    }
}

/// The page, or its live part.
pub fn respond(page: Page, fragment: LiveFragment) -> Response {
    respond_with(StatusCode::OK, page, fragment)
}

pub fn respond_with(status: StatusCode, page: Page, fragment: LiveFragment) -> Response {
    let body = if fragment.0 {
        page.live.into_string()
    } else {
        page.render().into_string()
    };
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

pub fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    let mut page = Page::new(title);
    page.live = problem(message);
    respond_with(status, page, LiveFragment(false))
}

/// The HTTP status that matches a service's answer.
pub fn status_of(error: &ApiError) -> StatusCode {
    match error.code {
        tonic::Code::NotFound => StatusCode::NOT_FOUND,
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => StatusCode::FORBIDDEN,
        tonic::Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// A service failed: say which, and what it answered.
pub fn api_error_page(title: &str, error: &ApiError, fragment: LiveFragment) -> Response {
    let mut page = Page::new(title);
    page.live = html! { (problem(&error.to_string())) };
    respond_with(status_of(error), page, fragment)
}
