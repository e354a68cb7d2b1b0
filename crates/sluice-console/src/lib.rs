//! The Sluice web console: every key and job at a glance, live, and limits
//! steered from the browser.
//!
//! Server-rendered HTML (axum + maud, which escapes everything it renders)
//! with one small script that refreshes each page's live part in place. The
//! console reads and changes Sluice only through the services' public
//! interfaces: their gRPC APIs, the owners' grant watch, and the
//! `jobs.admitted.*` and `deadletter` topics. It serves the standard gRPC
//! health service on the same port, so it is probed like the services.

pub mod actions;
pub mod activity;
pub mod feeds;
pub mod html;
mod pages;
pub mod services;
pub mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sluice_common::service::Supervisor;
use sluice_common::{Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::actions::ConfirmKey;
use crate::activity::{Activity, ActivityLimits};
use crate::services::Services;
use crate::watch::KeyWatch;

/// Why the console could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error(transparent)]
    Endpoint(#[from] services::EndpointError),
    #[error("console: Kafka client failed: {0}")]
    Kafka(#[source] rdkafka::error::KafkaError),
    #[error("console: {0}")]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("console: serving HTTP failed: {0}")]
    Serve(#[source] std::io::Error),
    #[error("console stopped: {0}")]
    Stopped(String),
}

/// How the background readers are doing, for the pages.
#[derive(Debug, Default)]
pub struct FeedStatus {
    pub grant_streams: usize,
    pub grant_error: Option<String>,
    pub kafka: String,
}

/// One tenant's line on the overview, cached for a refresh interval so many
/// viewers cost one scan.
#[derive(Clone, Debug, Default)]
pub struct TenantSummary {
    pub keys_scanned: usize,
    pub scan_truncated: bool,
    pub holders: u64,
    pub waiting: u64,
    pub top_keys: Vec<TopKey>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct TopKey {
    pub key: String,
    pub holders: u32,
    pub waiting: u32,
    pub max: Option<i64>,
    pub paused: bool,
}

/// The console's shared state.
pub struct Console {
    pub config: Arc<SluiceConfig>,
    pub services: Services,
    pub activity: Mutex<Activity>,
    pub watch: Mutex<KeyWatch>,
    pub feeds: Mutex<FeedStatus>,
    pub confirm: ConfirmKey,
    pub overview_cache: Mutex<HashMap<String, (Instant, TenantSummary)>>,
    /// Who may use the pages (with `auth.enabled`, admins presenting a
    /// bearer token).
    pub auth: sluice_common::auth::Authenticator,
}

/// Tenants tracked from what flows past.
const MAX_TENANTS: usize = 1_000;
/// Keys whose grants per second are counted.
const MAX_GRANT_KEYS: usize = 20_000;
/// Distinct dead-letter reasons counted.
const MAX_REASONS: usize = 256;

impl Console {
    pub fn new(config: Arc<SluiceConfig>) -> Result<Self, ConsoleError> {
        let services = Services::new(&config.console)?;
        let window = config.console.chart_window.0;
        let auth =
            sluice_common::auth::Authenticator::load(&config.auth).map_err(sluice_common::grpc::GrpcError::from)?;
        Ok(Console {
            auth,
            services,
            activity: Mutex::new(Activity::new(ActivityLimits {
                horizon_seconds: i64::try_from(window.as_secs()).unwrap_or(i64::MAX).max(60),
                max_keys: MAX_GRANT_KEYS,
                max_tenants: MAX_TENANTS,
                dead_letters_kept: config.console.dead_letters_kept,
                max_reasons: MAX_REASONS,
            })),
            watch: Mutex::new(KeyWatch::new(config.console.max_watched_keys, window)),
            feeds: Mutex::new(FeedStatus {
                kafka: "starting".to_string(),
                ..FeedStatus::default()
            }),
            confirm: ConfirmKey::random(),
            overview_cache: Mutex::new(HashMap::new()),
            config,
        })
    }

    pub fn refresh_ms(&self) -> u64 {
        u64::try_from(self.config.console.refresh_interval.0.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn window_ms(&self) -> i64 {
        i64::try_from(self.config.console.chart_window.0.as_millis()).unwrap_or(i64::MAX)
    }
}

/// A short critical section: a poisoned lock still holds consistent counts.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The console's routes, gRPC health included.
pub fn router(console: Arc<Console>, grpc: axum::Router) -> Router {
    Router::new()
        .route("/", get(pages::overview::page))
        .route("/keys", get(pages::keys::page))
        .route("/key", get(pages::key::page))
        .route("/job", get(pages::job::page))
        .route("/rate-limits", get(pages::rates::page))
        .route("/dead-letters", get(pages::dead_letters::page))
        .route("/actions", post(pages::confirm::submit))
        .route_layer(axum::middleware::from_fn_with_state(console.clone(), require_admin))
        .route("/assets/console.css", get(stylesheet))
        .route("/assets/console.js", get(script))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(console)
        .merge(grpc)
        .fallback(not_found)
        .layer(axum::middleware::map_response(security_headers))
}

/// With `auth.enabled`, the pages need a bearer token (JWT) of an admin in
/// the `Authorization` header: the console shows and steers every tenant.
/// Browsers send it through an authenticating proxy in front of the console
/// (oauth2-proxy's `--pass-authorization-header`, for one). Assets, `/healthz`
/// and gRPC health stay open.
async fn require_admin(
    axum::extract::State(console): axum::extract::State<Arc<Console>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let metadata = tonic::metadata::MetadataMap::from_headers(request.headers().clone());
    let principal = match console.auth.authenticate(&metadata, None) {
        Ok(principal) => principal,
        Err(status) => {
            let mut page = pages::error_page(
                StatusCode::UNAUTHORIZED,
                "Sign in",
                &format!(
                    "The console needs an admin's bearer token (sent by the authenticating proxy in front of it): {}",
                    status.message()
                ),
            );
            page.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"sluice-console\""),
            );
            return page;
        }
    };
    if !principal.is_admin() {
        return pages::error_page(
            StatusCode::FORBIDDEN,
            "Not allowed",
            &format!(
                "{} may not use the console: it shows and steers every tenant, so it needs the admin role",
                principal.name
            ),
        );
    }
    request.extensions_mut().insert(Arc::new(principal));
    next.run(request).await
}

async fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", html::CSS)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", html::JS)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=300"),
        ],
        body,
    )
        .into_response()
}

async fn not_found() -> Response {
    pages::error_page(StatusCode::NOT_FOUND, "Not found", "There is no such page.")
}

/// No framing, no sniffing, scripts and styles only from the console itself.
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
    );
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    // Not "no-referrer": under it browsers send `Origin: null` with the
    // console's own form posts, and the origin check could not tell them
    // from another site's. "same-origin" still tells other sites nothing.
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// Serve the console on `listener` until `shutdown`, with its background
/// readers. Takes the listener so tests and `sluice dev` bind their own.
pub async fn run(config: Arc<SluiceConfig>, listener: TcpListener, shutdown: Shutdown) -> Result<(), ConsoleError> {
    // The services it reads may speak TLS (`https://` endpoints, `tls.ca_file`).
    sluice_common::tls::configure_clients(&config.tls).map_err(sluice_common::grpc::GrpcError::from)?;
    // It calls them as a Sluice process (the internal token); its own pages
    // need an admin's bearer token (`require_admin`).
    sluice_common::auth::configure_clients(&config.auth).map_err(sluice_common::grpc::GrpcError::from)?;
    if config.auth.enabled {
        tracing::info!(listen = %config.console.listen, "console pages need an admin's bearer token (auth.enabled)");
    }
    let reflection = config.process.grpc_reflection;
    let drain_timeout = config.process.drain_timeout.0;
    let console = Arc::new(Console::new(config)?);
    let (routes, health) = sluice_common::grpc::base_routes(vec![], reflection)?;
    health.set_serving(true).await;
    let app = router(console.clone(), routes.routes().into_axum_router());
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "console listening");
    }
    let mut supervisor = Supervisor::new(shutdown.clone(), drain_timeout);
    supervisor.spawn(
        "console-grants",
        feeds::watch_all_grants(console.clone(), shutdown.clone()),
    );
    supervisor.spawn("console-kafka", feeds::read_kafka(console.clone(), shutdown.clone()));
    supervisor.spawn(
        "console-sampler",
        feeds::sample_watched_keys(console.clone(), shutdown.clone()),
    );
    let serving_shutdown = shutdown.clone();
    supervisor.spawn("console-http", async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { serving_shutdown.cancelled().await })
            .await
            .map_err(ConsoleError::Serve)
    });
    supervisor.wait().await.map_err(ConsoleError::Stopped)
}
