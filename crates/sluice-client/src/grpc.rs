//! gRPC channels to admission and the refresh-dispatcher. Channels connect
//! lazily and reconnect on their own, so building a client never waits for
//! the service.

use std::time::Duration;

use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::refresh_client::RefreshClient;
use tonic::transport::{Channel, Endpoint};

use crate::error::{Error, Result};
use crate::options::ClientOptions;

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
    let endpoint = self::endpoint(endpoint, &options.tls())
        .map_err(|error| Error::Config {
            field,
            message: format!("{endpoint:?} is not a URL: {error}"),
        })?
        .connect_timeout(Duration::from_secs(5))
        .timeout(options.request_timeout)
        .tcp_nodelay(true);
    Ok(endpoint.connect_lazy())
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
