//! Certificates for TLS tests, generated at test time (rcgen): a CA and a
//! certificate for 127.0.0.1 and localhost signed by it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use sluice_common::tls::TlsConfig;
use sluice_common::Shutdown;
use tonic::service::RoutesBuilder;

/// A CA, and a certificate for 127.0.0.1 and localhost signed by it.
pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    /// A client certificate (PEM certificate, PEM key) named `name` (its
    /// common name and a DNS subject alternative name), signed by the CA.
    pub fn client_certificate(&self, name: &str) -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_string()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

pub fn new_pki(name: &str) -> anyhow::Result<Pki> {
    new_pki_for(name, &["127.0.0.1", "localhost"])
}

/// A CA, and a certificate for `names` (host names or IP addresses) signed
/// by it.
pub fn new_pki_for(name: &str, names: &[&str]) -> anyhow::Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} CA"));
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.iter().map(|name| name.to_string()).collect::<Vec<_>>())?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} server"));
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Pki {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        issuer,
    })
}

/// A folder of its own for one test's files.
pub fn folder(name: &str) -> anyhow::Result<PathBuf> {
    let folder = std::env::temp_dir().join(format!("sluice-tls-{name}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&folder)?;
    Ok(folder)
}

/// Write `pki`'s files into `folder`; returns (cert, key, ca) paths.
pub fn write_pki(folder: &Path, pki: &Pki) -> anyhow::Result<(String, String, String)> {
    let path = |file: &str| folder.join(file).to_string_lossy().into_owned();
    // Written beside, then renamed: a reader never sees half a file.
    for (file, text) in [
        ("tls.crt", &pki.cert_pem),
        ("tls.key", &pki.key_pem),
        ("ca.crt", &pki.ca_pem),
    ] {
        std::fs::write(path(&format!("{file}.new")), text)?;
        std::fs::rename(path(&format!("{file}.new")), path(file))?;
    }
    Ok((path("tls.crt"), path("tls.key"), path("ca.crt")))
}

/// `[tls]` settings serving `cert` / `key`, requiring client certificates
/// signed by `client_ca` when it is not empty, read again every `reload`.
pub fn server_tls(cert: &str, key: &str, client_ca: &str, reload: Duration) -> TlsConfig {
    TlsConfig {
        cert_file: cert.to_string(),
        key_file: key.to_string(),
        client_ca_file: client_ca.to_string(),
        ca_file: String::new(),
        server_name: String::new(),
        reload_interval: sluice_common::config::HumanDuration(reload),
    }
}

/// Serve `routes` over the TLS of `config` on 127.0.0.1:0 until `stop`;
/// returns the `https://` endpoint.
pub async fn serve_over_tls(routes: RoutesBuilder, config: &TlsConfig, stop: &Shutdown) -> anyhow::Result<String> {
    Ok(serve_over_tls_watched(routes, config, stop).await?.0)
}

/// The same, with the server's TLS configuration (to see its reloads).
pub async fn serve_over_tls_watched(
    routes: RoutesBuilder,
    config: &TlsConfig,
    stop: &Shutdown,
) -> anyhow::Result<(String, std::sync::Arc<sluice_common::tls::ServerTls>)> {
    let listener = sluice_common::grpc::bind("127.0.0.1:0").await?;
    let endpoint = format!("https://{}", listener.local_addr()?);
    let tls = sluice_common::tls::ServerTls::load(config)?;
    let Some(watched) = tls.clone() else {
        anyhow::bail!("TLS is on when a certificate is configured");
    };
    let defaults = sluice_common::SluiceConfig::load_with(None, &[])?;
    let limits = sluice_common::grpc::ServerLimits::of(&defaults.process);
    tokio::spawn(sluice_common::grpc::serve(listener, routes, tls, limits, stop.clone()));
    Ok((endpoint, watched))
}

/// A server with only health (SERVING) over the TLS of `config`.
pub async fn health_over_tls_server(config: &TlsConfig, stop: &Shutdown) -> anyhow::Result<String> {
    Ok(health_over_tls_server_watched(config, stop).await?.0)
}

/// The same, with the server's TLS configuration (to see its reloads).
pub async fn health_over_tls_server_watched(
    config: &TlsConfig,
    stop: &Shutdown,
) -> anyhow::Result<(String, std::sync::Arc<sluice_common::tls::ServerTls>)> {
    let (routes, health) = sluice_common::grpc::base_routes(vec![], false)?;
    health.set_serving(true).await;
    serve_over_tls_watched(routes, config, stop).await
}
