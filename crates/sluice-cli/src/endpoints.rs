//! Where the CLI reaches the four services: flags, environment variables,
//! and the local dev ports by default.

use std::time::Duration;

use anyhow::Context;
use sluice_common::auth::Channel;
use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use sluice_proto::v1::refresh_client::RefreshClient;

use crate::output::RpcError;

/// gRPC endpoints of the services. Any instance of a service will do: calls
/// that decide on a key are forwarded to its owner.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Endpoints")]
pub struct Endpoints {
    /// Admission (jobs).
    #[arg(
        long = "admission",
        global = true,
        env = "SLUICE_ADMISSION_ENDPOINT",
        default_value = "http://127.0.0.1:50051",
        value_name = "URL"
    )]
    pub admission: String,
    /// limit-grant (concurrency and floating keys).
    #[arg(
        long = "limit-grant",
        global = true,
        env = "SLUICE_LIMIT_GRANT_ENDPOINT",
        default_value = "http://127.0.0.1:50052",
        value_name = "URL"
    )]
    pub limit_grant: String,
    /// rate-window (rate limits).
    #[arg(
        long = "rate-window",
        global = true,
        env = "SLUICE_RATE_WINDOW_ENDPOINT",
        default_value = "http://127.0.0.1:50053",
        value_name = "URL"
    )]
    pub rate_window: String,
    /// refresh-dispatcher (floating-limit refreshes).
    #[arg(
        long = "refresh-dispatcher",
        global = true,
        env = "SLUICE_REFRESH_DISPATCHER_ENDPOINT",
        default_value = "http://127.0.0.1:50054",
        value_name = "URL"
    )]
    pub refresh_dispatcher: String,
    /// CA certificate (PEM) trusted for `https://` endpoints (the
    /// services' `tls.ca_file`).
    #[arg(long, global = true, env = "SLUICE_TLS_CA_FILE", value_name = "PEM")]
    pub tls_ca_file: Option<String>,
    /// Client certificate (PEM) for services that require one
    /// (`tls.client_ca_file`); with `--tls-key-file`.
    #[arg(
        long,
        global = true,
        env = "SLUICE_TLS_CERT_FILE",
        value_name = "PEM",
        requires = "tls_key_file"
    )]
    pub tls_cert_file: Option<String>,
    /// The name to check in the services' certificates, whatever address is
    /// dialled (the services' `tls.server_name`).
    #[arg(long, global = true, env = "SLUICE_TLS_SERVER_NAME", value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// The key of `--tls-cert-file` (PEM).
    #[arg(
        long,
        global = true,
        env = "SLUICE_TLS_KEY_FILE",
        value_name = "PEM",
        requires = "tls_cert_file"
    )]
    pub tls_key_file: Option<String>,
    /// A file holding the bearer token (JWT) sent on every call, for
    /// services with `auth.enabled`.
    #[arg(long, global = true, env = "SLUICE_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<String>,
}

impl Endpoints {
    /// What this command's channels trust and present: TLS files and the
    /// bearer token.
    pub fn configure_clients(&self) -> anyhow::Result<()> {
        if let Some(path) = &self.token_file {
            let token = std::fs::read_to_string(path).with_context(|| format!("--token-file: cannot read {path:?}"))?;
            sluice_common::auth::set_client_token(&token).with_context(|| format!("--token-file {path:?}"))?;
        }
        let identity = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some((cert.as_str(), key.as_str())),
            _ => None,
        };
        sluice_common::tls::configure_client_files(
            self.tls_ca_file.as_deref(),
            identity,
            self.tls_server_name.as_deref(),
        )?;
        Ok(())
    }
}

/// `127.0.0.1:50051` and `http://127.0.0.1:50051` both work.
pub fn normalized(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    }
}

/// A channel that connects on first use: an unreachable service shows up as
/// the call's `UNAVAILABLE`, with the service and endpoint named.
pub fn channel(endpoint: &str) -> anyhow::Result<Channel> {
    let endpoint = normalized(endpoint);
    let channel = sluice_common::tls::endpoint(&endpoint)
        .with_context(|| format!("bad endpoint {endpoint:?}"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(15))
        .connect_lazy();
    Ok(sluice_common::auth::with_credentials(channel))
}

/// A client of one service, with what to say when a call fails.
pub struct Service<C> {
    pub client: C,
    pub name: &'static str,
    pub endpoint: String,
}

impl<C> Service<C> {
    pub fn error(&self, status: tonic::Status) -> RpcError {
        RpcError::new(self.name, &self.endpoint, status)
    }
}

impl Endpoints {
    pub fn admission(&self) -> anyhow::Result<Service<AdmissionClient<Channel>>> {
        Ok(Service {
            client: AdmissionClient::new(channel(&self.admission)?),
            name: "admission",
            endpoint: normalized(&self.admission),
        })
    }

    pub fn limits(&self) -> anyhow::Result<Service<LimitsClient<Channel>>> {
        Ok(Service {
            client: LimitsClient::new(channel(&self.limit_grant)?),
            name: "limit-grant",
            endpoint: normalized(&self.limit_grant),
        })
    }

    pub fn rates(&self) -> anyhow::Result<Service<RateLimitsClient<Channel>>> {
        Ok(Service {
            client: RateLimitsClient::new(channel(&self.rate_window)?),
            name: "rate-window",
            endpoint: normalized(&self.rate_window),
        })
    }

    pub fn refresh(&self) -> anyhow::Result<Service<RefreshClient<Channel>>> {
        Ok(Service {
            client: RefreshClient::new(channel(&self.refresh_dispatcher)?),
            name: "refresh-dispatcher",
            endpoint: normalized(&self.refresh_dispatcher),
        })
    }

    /// Every service with its endpoint, for `sluice health`.
    pub fn all(&self) -> [(&'static str, String); 4] {
        [
            ("admission", normalized(&self.admission)),
            ("limit-grant", normalized(&self.limit_grant)),
            ("rate-window", normalized(&self.rate_window)),
            ("refresh-dispatcher", normalized(&self.refresh_dispatcher)),
        ]
    }
}
