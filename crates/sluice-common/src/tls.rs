//! TLS for gRPC (rustls, through tonic's TLS support and tokio-rustls).
//!
//! A server presents the certificate in `tls.cert_file` / `tls.key_file`
//! and re-reads both files every `tls.reload_interval`: a rotated
//! certificate (cert-manager) is served to new connections without a
//! restart, and a pair that does not load is logged and the previous one
//! kept. With `tls.client_ca_file` set, a server requires client
//! certificates signed by that CA (mutual TLS).
//!
//! Clients (the services' calls to each other, `sluice`, the SDK) use TLS
//! for `https://` endpoints, trusting `tls.ca_file`, and present the same
//! certificate pair as their client certificate when one is configured.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls;

use crate::shutdown::Shutdown;

pub use crate::config::TlsConfig;

impl TlsConfig {
    pub fn server_enabled(&self) -> bool {
        !self.cert_file.trim().is_empty() || !self.key_file.trim().is_empty()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls.{setting}: cannot read {path:?}")]
    Read {
        setting: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tls.{setting}: {path:?} holds no usable {what} (PEM expected)")]
    Pem {
        setting: &'static str,
        path: String,
        what: &'static str,
    },
    #[error("tls: set both cert_file and key_file (one is empty)")]
    HalfPair,
    #[error("tls: {0}")]
    Rustls(String),
}

fn read(setting: &'static str, path: &str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path.trim()).map_err(|source| TlsError::Read {
        setting,
        path: path.to_string(),
        source,
    })
}

fn certificates(setting: &'static str, path: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|_| TlsError::Pem {
                setting,
                path: path.to_string(),
                what: "certificate",
            })?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            setting,
            path: path.to_string(),
            what: "certificate",
        });
    }
    Ok(chain)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The files a server configuration is built from, as last read.
#[derive(PartialEq, Eq)]
struct ServerFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl ServerFiles {
    fn read(config: &TlsConfig) -> Result<Self, TlsError> {
        if config.cert_file.trim().is_empty() || config.key_file.trim().is_empty() {
            return Err(TlsError::HalfPair);
        }
        let client_ca = if config.client_ca_file.trim().is_empty() {
            None
        } else {
            Some(read("client_ca_file", &config.client_ca_file)?)
        };
        Ok(ServerFiles {
            cert: read("cert_file", &config.cert_file)?,
            key: read("key_file", &config.key_file)?,
            client_ca,
        })
    }

    fn server_config(&self, config: &TlsConfig) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let chain = certificates("cert_file", &config.cert_file, &self.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|_| TlsError::Pem {
            setting: "key_file",
            path: config.key_file.clone(),
            what: "private key",
        })?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|error| TlsError::Rustls(error.to_string()))?;
        let builder = match &self.client_ca {
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for certificate in certificates("client_ca_file", &config.client_ca_file, pem)? {
                    roots
                        .add(certificate)
                        .map_err(|error| TlsError::Rustls(format!("tls.client_ca_file: {error}")))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .build()
                    .map_err(|error| TlsError::Rustls(format!("tls.client_ca_file: {error}")))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut server = builder
            .with_single_cert(chain, key)
            .map_err(|error| TlsError::Rustls(format!("tls.cert_file / tls.key_file: {error}")))?;
        // gRPC is HTTP/2.
        server.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(server))
    }
}

/// A server's TLS configuration, replaced when its files change.
pub struct ServerTls {
    config: TlsConfig,
    current: RwLock<(ServerFiles, Arc<rustls::ServerConfig>)>,
    /// Reloads that found changed files that do not load.
    refused: std::sync::atomic::AtomicU64,
}

impl ServerTls {
    /// `None` when TLS is off (no certificate configured). A configuration
    /// that does not load is an error: a server never falls back to
    /// plaintext.
    pub fn load(config: &TlsConfig) -> Result<Option<Arc<Self>>, TlsError> {
        if !config.server_enabled() {
            return Ok(None);
        }
        let files = ServerFiles::read(config)?;
        let server = files.server_config(config)?;
        Ok(Some(Arc::new(ServerTls {
            config: config.clone(),
            current: RwLock::new((files, server)),
            refused: std::sync::atomic::AtomicU64::new(0),
        })))
    }

    /// The configuration new connections get.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let current = self.current.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        tokio_rustls::TlsAcceptor::from(current.1.clone())
    }

    /// Read the files again; replace the configuration when they changed
    /// and load. Returns whether it was replaced.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let files = ServerFiles::read(&self.config)?;
        {
            let current = self.current.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            if current.0 == files {
                return Ok(false);
            }
        }
        let server = files.server_config(&self.config)?;
        *self.current.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = (files, server);
        Ok(true)
    }

    /// How many reloads found changed files that do not load (each one kept
    /// the previous configuration).
    pub fn refused_reloads(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reload every `reload_interval` until `shutdown`.
    pub async fn watch(self: Arc<Self>, shutdown: Shutdown) {
        let every = self.config.reload_interval.0.max(Duration::from_millis(100));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            match self.reload() {
                Ok(true) => tracing::info!(cert_file = %self.config.cert_file, "TLS certificate reloaded"),
                Ok(false) => {}
                Err(error) => {
                    self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(%error, "TLS certificate files changed but do not load; serving the previous ones");
                }
            }
        }
    }
}

/// What `https://` clients of this process trust and present.
#[derive(Clone, Default)]
struct ClientSettings {
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    server_name: Option<String>,
}

static CLIENT: RwLock<Option<ClientSettings>> = RwLock::new(None);

/// Set what this process's `https://` clients trust (`tls.ca_file`) and
/// present (the certificate pair, when the server side requires client
/// certificates). Read once per new channel.
pub fn configure_clients(config: &TlsConfig) -> Result<(), TlsError> {
    let identity = (config.server_enabled() && !config.client_ca_file.trim().is_empty())
        .then_some((config.cert_file.as_str(), config.key_file.as_str()));
    configure_client_files(
        Some(config.ca_file.as_str()),
        identity,
        Some(config.server_name.as_str()),
    )
}

/// The same from files named directly (the `sluice` command's flags):
/// `ca_file` trusted, `identity` (certificate, key) presented,
/// `server_name` checked in the servers' certificates. Empty or `None`: not
/// set.
pub fn configure_client_files(
    ca_file: Option<&str>,
    identity: Option<(&str, &str)>,
    server_name: Option<&str>,
) -> Result<(), TlsError> {
    let ca = match ca_file.map(str::trim) {
        Some(path) if !path.is_empty() => {
            let pem = read("ca_file", path)?;
            certificates("ca_file", path, &pem)?;
            Some(pem)
        }
        _ => None,
    };
    let identity = match identity {
        Some((cert, key)) => {
            let (cert_pem, key_pem) = (read("cert_file", cert)?, read("key_file", key)?);
            certificates("cert_file", cert, &cert_pem)?;
            PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::Pem {
                setting: "key_file",
                path: key.to_string(),
                what: "private key",
            })?;
            Some((cert_pem, key_pem))
        }
        None => None,
    };
    let server_name = server_name
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_string);
    *CLIENT.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(ClientSettings {
        ca,
        identity,
        server_name,
    });
    Ok(())
}

/// An endpoint for `url`: TLS for `https://`, trusting the configured CA.
pub fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.trim().to_string())?;
    if !url.trim().starts_with("https://") {
        return Ok(endpoint);
    }
    let settings = CLIENT
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone()
        .unwrap_or_default();
    let mut tls = client_tls(settings.ca.as_deref(), settings.identity);
    if let Some(name) = settings.server_name {
        tls = tls.domain_name(name);
    }
    endpoint.tls_config(tls)
}

/// A client TLS configuration trusting `ca` (PEM) and presenting `identity`
/// (certificate chain and key, PEM).
pub fn client_tls(ca: Option<&[u8]>, identity: Option<(Vec<u8>, Vec<u8>)>) -> tonic::transport::ClientTlsConfig {
    let mut tls = tonic::transport::ClientTlsConfig::new();
    if let Some(ca) = ca {
        tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(ca));
    }
    if let Some((cert, key)) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
    }
    tls
}
