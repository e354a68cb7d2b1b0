//! A stack with a console in front of it, an HTTP client, and the little
//! HTML reading the tests need.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use sluice_common::config::HumanDuration;
use sluice_common::Shutdown;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use tokio::task::JoinHandle;

/// A stack, and a console reading it.
pub struct ConsoleStack {
    pub stack: Stack,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// Unique to the test; the console lists it on the overview.
    pub tenant: String,
    shutdown: Shutdown,
    console: Option<JoinHandle<Result<(), sluice_console::ConsoleError>>>,
}

impl ConsoleStack {
    pub async fn start(name: &str) -> anyhow::Result<ConsoleStack> {
        Self::start_with(name, &[]).await
    }

    /// The same with settings of its own (TLS, say).
    pub async fn start_with(name: &str, overrides: &[(&str, &str)]) -> anyhow::Result<ConsoleStack> {
        let stack = Stack::start(test_config(name, overrides)?, 1).await?;
        let tenant = format!("{}tenant", stack.config.kafka.topic_prefix);
        let mut config = (*stack.config).clone();
        let console = &mut config.console;
        console.admission_endpoint = stack.admissions.first().context("no admission")?.endpoint.clone();
        console.limit_grant_endpoint = stack.limit_grant_service.endpoint.clone();
        console.rate_window_endpoint = stack.rate_window_service.endpoint.clone();
        console.refresh_dispatcher_endpoint = stack
            .refresh_dispatchers
            .first()
            .context("no refresh-dispatcher")?
            .endpoint
            .clone();
        console.tenants = vec![tenant.clone()];
        console.refresh_interval = HumanDuration(Duration::from_millis(500));
        console.sample_interval = HumanDuration(Duration::from_millis(250));
        console.trace_url_template = "http://traces.example/search?job={job_id}&tenant={tenant}".to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let shutdown = Shutdown::new();
        let handle = tokio::spawn(sluice_console::run(Arc::new(config), listener, shutdown.clone()));
        Ok(ConsoleStack {
            stack,
            url,
            tenant,
            shutdown,
            console: Some(handle),
        })
    }

    pub fn http(&self) -> Http {
        Http {
            client: Client::builder(hyper_util::rt::TokioExecutor::new()).build_http(),
            base: self.url.clone(),
        }
    }

    /// Stop the console (it must stop cleanly) and the stack.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.trigger();
        if let Some(handle) = self.console.take() {
            tokio::time::timeout(Duration::from_secs(30), handle)
                .await
                .context("the console did not stop within 30s")??
                .context("the console stopped with an error")?;
        }
        self.stack.stop().await;
        Ok(())
    }

    /// Enqueue a job on one concurrency key of the test's tenant.
    pub async fn enqueue(&self, job_id: &str, key: &str, max: u32, priority: u32) -> anyhow::Result<String> {
        let mut request = concurrency_job(&self.tenant, key, max, priority, job_id);
        request.job_id = Some(job_id.to_string());
        let mut admission = self.stack.admission_client().await?;
        Ok(admission
            .enqueue(pb::EnqueueRequest { job: Some(request) })
            .await?
            .into_inner()
            .job_id)
    }

    pub async fn key_state(&self, key: &str) -> anyhow::Result<pb::KeyState> {
        key_state(&self.stack, &self.tenant, key).await
    }

    /// Wait until `key` has these holders and waiters (in grant order).
    pub async fn wait_key(&self, key: &str, holders: &[&str], waiters: &[&str]) -> anyhow::Result<()> {
        eventually(
            Duration::from_secs(60),
            &format!("{key}: holders {holders:?}, waiters {waiters:?}"),
            || async {
                let state = self.key_state(key).await?;
                let held: Vec<&str> = state
                    .holders
                    .iter()
                    .filter_map(|holder| holder.ticket.as_ref().map(|ticket| ticket.job_id.as_str()))
                    .collect();
                let waiting: Vec<&str> = state
                    .first_waiters
                    .iter()
                    .filter_map(|waiter| waiter.ticket.as_ref().map(|ticket| ticket.job_id.as_str()))
                    .collect();
                Ok(held == holders && waiting == waiters)
            },
        )
        .await
    }
}

pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub location: Option<String>,
    pub content_type: String,
    pub body: String,
}

impl Http {
    async fn send(&self, request: axum::http::Request<Full<Bytes>>) -> anyhow::Result<Answer> {
        let response = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .context("the console did not answer within 30s")??;
        let status = response.status().as_u16();
        let header = |name: axum::http::HeaderName| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
        };
        let location = header(axum::http::header::LOCATION);
        let content_type = header(axum::http::header::CONTENT_TYPE).unwrap_or_default();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Answer {
            status,
            location,
            content_type,
            body: String::from_utf8(body.to_vec())?,
        })
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Answer> {
        self.send(axum::http::Request::get(format!("{}{path}", self.base)).body(Full::new(Bytes::new()))?)
            .await
    }

    /// A page asked for with `authorization: Bearer <token>`.
    pub async fn get_as(&self, path: &str, token: &str) -> anyhow::Result<Answer> {
        self.send(
            axum::http::Request::get(format!("{}{path}", self.base))
                .header("authorization", format!("Bearer {token}"))
                .body(Full::new(Bytes::new()))?,
        )
        .await
    }

    /// The live part only, as the page's script asks for it.
    pub async fn get_live(&self, path: &str) -> anyhow::Result<Answer> {
        self.send(
            axum::http::Request::get(format!("{}{path}", self.base))
                .header("x-console-fragment", "live")
                .body(Full::new(Bytes::new()))?,
        )
        .await
    }

    pub async fn post_form(&self, path: &str, fields: &[(&str, &str)], origin: Option<&str>) -> anyhow::Result<Answer> {
        let body = fields
            .iter()
            .map(|(name, value)| format!("{}={}", form_encode(name), form_encode(value)))
            .collect::<Vec<_>>()
            .join("&");
        let mut request = axum::http::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded");
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        self.send(request.body(Full::new(Bytes::from(body)))?).await
    }
}

fn form_encode(text: &str) -> String {
    sluice_console::html::encode(text)
}

/// Text as maud writes it in HTML (text and attribute values).
pub fn escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// HTML entities back to text (what maud escapes).
pub fn unescaped(text: &str) -> String {
    text.replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// The part of `html` from the element with `id` to the first `closing`
/// after it (the console's own markup nests no such element in them).
pub fn element<'a>(html: &'a str, id: &str, closing: &str) -> Option<&'a str> {
    let start = html.find(&format!("id=\"{id}\""))?;
    let rest = &html[start..];
    let end = rest.find(closing)? + closing.len();
    Some(&rest[..end])
}

/// Every value of `attribute` in `html`, in order, unescaped.
pub fn attribute_values(html: &str, attribute: &str) -> Vec<String> {
    let marker = format!("{attribute}=\"");
    let mut values = Vec::new();
    let mut rest = html;
    while let Some(at) = rest.find(&marker) {
        rest = &rest[at + marker.len()..];
        let Some(end) = rest.find('"') else {
            break;
        };
        values.push(unescaped(&rest[..end]));
        rest = &rest[end..];
    }
    values
}

/// The confirmation token of a confirmation page.
pub fn confirmation_token(html: &str) -> Option<String> {
    let marker = "name=\"token\" value=\"";
    let at = html.find(marker)? + marker.len();
    let end = html[at..].find('"')?;
    Some(html[at..at + end].to_string())
}
