//! The few W3C WebDriver commands the browser tests use, as JSON over HTTP
//! to chromedriver. A WebDriver client crate would bring two dozen crates
//! into the test build (and feature sets `make run` does not share) for
//! these ten requests.

use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Bytes;
use base64::Engine as _;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};

/// The key under which WebDriver names an element (W3C).
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One WebDriver session.
pub struct Session {
    client: Client<HttpConnector, Full<Bytes>>,
    /// `http://127.0.0.1:PORT/session/ID`
    base: String,
}

/// An element a CSS selector found.
pub struct Element<'a> {
    session: &'a Session,
    id: String,
}

impl Session {
    /// A new session on the WebDriver server at `server`
    /// (`http://127.0.0.1:PORT`) with these capabilities.
    pub async fn start(server: &str, capabilities: Value) -> anyhow::Result<Session> {
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        let created = send(
            &client,
            "POST",
            &format!("{server}/session"),
            Some(json!({ "capabilities": { "alwaysMatch": capabilities } })),
        )
        .await?;
        let id = created["sessionId"]
            .as_str()
            .with_context(|| format!("no sessionId in {created}"))?;
        Ok(Session {
            client,
            base: format!("{server}/session/{id}"),
        })
    }

    async fn command(&self, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        send(&self.client, method, &format!("{}{path}", self.base), body).await
    }

    pub async fn goto(&self, url: &str) -> anyhow::Result<()> {
        self.command("POST", "/url", Some(json!({ "url": url }))).await?;
        Ok(())
    }

    /// The page's address, e.g. `http://127.0.0.1:PORT/key?done=x`.
    pub async fn current_url(&self) -> anyhow::Result<String> {
        let url = self.command("GET", "/url", None).await?;
        url.as_str()
            .map(str::to_string)
            .with_context(|| format!("an address, not {url}"))
    }

    /// Run `script` (a function body) with `args`; what it returns.
    pub async fn execute(&self, script: &str, args: Vec<Value>) -> anyhow::Result<Value> {
        self.command("POST", "/execute/sync", Some(json!({ "script": script, "args": args })))
            .await
    }

    /// The visible page as PNG.
    pub async fn screenshot(&self) -> anyhow::Result<Vec<u8>> {
        let encoded = self.command("GET", "/screenshot", None).await?;
        let encoded = encoded.as_str().with_context(|| format!("base64 PNG, not {encoded}"))?;
        Ok(base64::engine::general_purpose::STANDARD.decode(encoded)?)
    }

    /// The first element `css` selects; an error when there is none.
    pub async fn find(&self, css: &str) -> anyhow::Result<Element<'_>> {
        let found = self
            .command(
                "POST",
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await
            .with_context(|| format!("finding {css}"))?;
        let id = found[ELEMENT_KEY]
            .as_str()
            .with_context(|| format!("no element reference in {found}"))?;
        Ok(Element {
            session: self,
            id: id.to_string(),
        })
    }

    /// Wait (up to `within`) until `css` selects an element.
    pub async fn wait_for_element(&self, css: &str, within: Duration) -> anyhow::Result<Element<'_>> {
        let deadline = Instant::now() + within;
        loop {
            match self.find(css).await {
                Ok(element) => return Ok(element),
                Err(error) if Instant::now() >= deadline => {
                    return Err(error.context(format!("{css} did not appear within {within:?}")))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// End the session (the browser closes).
    pub async fn close(&self) -> anyhow::Result<()> {
        send(&self.client, "DELETE", &self.base, None).await?;
        Ok(())
    }
}

impl Element<'_> {
    async fn command(&self, action: &str, body: Value) -> anyhow::Result<()> {
        self.session
            .command("POST", &format!("/element/{}/{action}", self.id), Some(body))
            .await?;
        Ok(())
    }

    pub async fn clear(&self) -> anyhow::Result<()> {
        self.command("clear", json!({})).await
    }

    pub async fn send_keys(&self, text: &str) -> anyhow::Result<()> {
        self.command("value", json!({ "text": text })).await
    }

    pub async fn click(&self) -> anyhow::Result<()> {
        self.command("click", json!({})).await
    }
}

/// One WebDriver request; the answer's `value`, or its error as an error.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let request = axum::http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json; charset=utf-8")
        .body(Full::new(Bytes::from(
            body.map(|body| body.to_string()).unwrap_or_default(),
        )))?;
    let response = tokio::time::timeout(Duration::from_secs(60), client.request(request))
        .await
        .with_context(|| format!("WebDriver did not answer {method} {url} within 60s"))??;
    let status = response.status();
    let answer = response.into_body().collect().await?.to_bytes();
    let answer: Value =
        serde_json::from_slice(&answer).with_context(|| format!("{method} {url}: {status}, not JSON"))?;
    let value = answer.get("value").cloned().unwrap_or(Value::Null);
    anyhow::ensure!(
        status.is_success(),
        "{method} {url}: {status} {}: {}",
        value["error"],
        value["message"]
    );
    Ok(value)
}
