//! gRPC channels to admission and the refresh-dispatcher. Channels connect
//! lazily and reconnect on their own, so building a client never waits for
//! the service.

use std::time::Duration;

use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::refresh_client::RefreshClient;
use tonic::transport::Endpoint;

use crate::error::{Error, Result};
use crate::options::ClientOptions;

/// Adds the configured bearer token to every call.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bearer(pub Option<tonic::metadata::AsciiMetadataValue>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// A channel whose calls carry the bearer token.
pub(crate) type Channel = tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>;

/// How to reach the services: TLS settings and credentials.
#[derive(Clone, Debug)]
pub(crate) struct Dial {
    pub tls: tonic::transport::ClientTlsConfig,
    pub bearer: Bearer,
}

/// An endpoint for `url`: TLS for `https://` with `tls`.
pub(crate) fn endpoint(
    url: &str,
    tls: &tonic::transport::ClientTlsConfig,
) -> std::result::Result<Endpoint, tonic::transport::Error> {
    let endpoint = Endpoint::from_shared(url.trim().to_string())?;
    if url.trim().starts_with("https://") {
        return endpoint.tls_config(tls.clone());
    }
    Ok(endpoint)
}

fn lazy_channel(field: &'static str, endpoint: &str, options: &ClientOptions) -> Result<Channel> {
    if endpoint.trim().is_empty() {
        return Err(Error::Config {
            field,
            message: "must not be empty".to_string(),
        });
    }
    let dial = options.dial()?;
    let endpoint = self::endpoint(endpoint, &dial.tls)
        .map_err(|error| Error::Config {
            field,
            message: format!("{endpoint:?} is not a URL: {error}"),
        })?
        .connect_timeout(Duration::from_secs(5))
        .timeout(options.request_timeout)
        .tcp_nodelay(true);
    Ok(Channel::new(endpoint.connect_lazy(), dial.bearer))
}

/// An admission client and the endpoint it talks to (for errors).
#[derive(Clone, Debug)]
pub(crate) struct Admission {
    pub client: AdmissionClient<Channel>,
    pub endpoint: String,
}

impl Admission {
    pub fn new(endpoint: &str, options: &ClientOptions) -> Result<Self> {
        Ok(Admission {
            client: AdmissionClient::new(lazy_channel("admission_endpoint", endpoint, options)?),
            endpoint: endpoint.to_string(),
        })
    }
}

/// A refresh-dispatcher client.
#[derive(Clone, Debug)]
pub(crate) struct Refresh {
    pub client: RefreshClient<Channel>,
    pub endpoint: String,
}

impl Refresh {
    pub fn new(endpoint: &str, options: &ClientOptions) -> Result<Self> {
        Ok(Refresh {
            client: RefreshClient::new(lazy_channel("refresh_endpoint", endpoint, options)?),
            endpoint: endpoint.to_string(),
        })
    }
}
