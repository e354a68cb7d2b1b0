//! TLS on gRPC (issue 14): certificates generated here with rcgen. A whole
//! stack serves only TLS and its services reach each other over it; a
//! plaintext client is refused; a rotated certificate is served without a
//! restart; with a client CA, a client without a certificate is refused.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_common::Shutdown;
use sluice_e2e::pki::{
    folder, health_over_tls_server, health_over_tls_server_watched, new_pki, new_pki_for, server_tls, write_pki,
};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

/// Health over a new channel to `endpoint`, trusting `ca` and presenting
/// `identity`.
async fn health_over_tls(endpoint: &str, ca: &str, identity: Option<(&str, &str)>) -> anyhow::Result<()> {
    health_over_tls_as(endpoint, ca, identity, None).await
}

/// The same, checking `server_name` in the certificate instead of the host
/// dialled.
async fn health_over_tls_as(
    endpoint: &str,
    ca: &str,
    identity: Option<(&str, &str)>,
    server_name: Option<&str>,
) -> anyhow::Result<()> {
    let mut tls = sluice_common::tls::client_tls(
        Some(ca.as_bytes()),
        identity.map(|(cert, key)| (cert.as_bytes().to_vec(), key.as_bytes().to_vec())),
    );
    if let Some(name) = server_name {
        tls = tls.domain_name(name);
    }
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await?;
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_serves_only_tls_and_its_services_reach_each_other_over_it() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("stack")?;
    // As in Kubernetes: the certificate names the service, not the
    // addresses instances advertise (127.0.0.1 here, pod IPs there).
    let pki = new_pki_for("stack", &["sluice.internal"])?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let config = test_config(
        "tlsstack",
        &[
            ("tls.cert_file", cert.as_str()),
            ("tls.key_file", key.as_str()),
            ("tls.ca_file", ca.as_str()),
            ("tls.server_name", "sluice.internal"),
        ],
    )?;
    let stack = Stack::start(config, 1).await?;
    let admission_endpoint = stack.admissions[0].endpoint.clone();
    assert!(admission_endpoint.starts_with("https://"), "{admission_endpoint}");

    // An SDK worker on a Work stream over TLS, trusting the CA.
    let options = sluice_client::ClientOptions {
        brokers: String::new(),
        admission_endpoint: admission_endpoint.clone(),
        tls_ca_pem: Some(pki.ca_pem.as_bytes().to_vec()),
        tls_server_name: Some("sluice.internal".to_string()),
        ..sluice_client::ClientOptions::default()
    };
    let (ran, token) = start_counting_stream_worker(options).await?;

    // A job under a concurrency limit runs: admission asked limit-grant
    // over its TLS link, got the grant back, and pushed the job to the
    // worker over TLS.
    let mut admission = stack.admission_client().await?;
    let job_id = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(concurrency_job("acme", "tls-key", 1, 5, "over tls")),
        })
        .await?
        .into_inner()
        .job_id;
    wait_status(&admission, &job_id, pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    token.cancel();

    // A plaintext client gets no answer from a TLS server.
    let plaintext = admission_endpoint.replacen("https://", "http://", 1);
    let refused = tokio::time::timeout(Duration::from_secs(20), async {
        let channel = tonic::transport::Endpoint::from_shared(plaintext.clone())?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5))
            .connect()
            .await?;
        tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await?;
        anyhow::Ok(())
    })
    .await;
    assert!(
        !matches!(refused, Ok(Ok(()))),
        "a plaintext client was answered by {plaintext}"
    );
    // A client trusting another CA is refused too.
    let stranger = new_pki_for("stranger", &["sluice.internal"])?;
    let internal = Some("sluice.internal");
    assert!(
        health_over_tls_as(&admission_endpoint, &stranger.ca_pem, None, internal)
            .await
            .is_err()
    );
    assert!(
        health_over_tls(&admission_endpoint, &pki.ca_pem, None).await.is_err(),
        "the certificate does not name 127.0.0.1"
    );
    health_over_tls_as(&admission_endpoint, &pki.ca_pem, None, internal).await?;
    stack.stop().await;
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_a_restart() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("rotate")?;
    let first = new_pki("first")?;
    let (cert, key, _) = write_pki(&folder, &first)?;
    let config = server_tls(&cert, &key, "", Duration::from_millis(100));
    let stop = Shutdown::new();
    let (endpoint, server) = health_over_tls_server_watched(&config, &stop).await?;
    health_over_tls(&endpoint, &first.ca_pem, None).await?;

    // cert-manager writes a certificate from another CA.
    let second = new_pki("second")?;
    write_pki(&folder, &second)?;
    eventually(Duration::from_secs(30), "the new certificate served", || async {
        Ok(health_over_tls(&endpoint, &second.ca_pem, None).await.is_ok())
    })
    .await?;
    assert!(
        health_over_tls(&endpoint, &first.ca_pem, None).await.is_err(),
        "new connections no longer get the old certificate"
    );

    // A pair that does not load keeps the last good one.
    // (A reload between the two files of a rotation may have refused a
    // mismatched pair already: count from here.)
    let refused_before = server.refused_reloads();
    std::fs::write(folder.join("tls.key"), "not a key")?;
    eventually(Duration::from_secs(30), "the reload that refuses the pair", || async {
        Ok(server.refused_reloads() > refused_before)
    })
    .await?;
    health_over_tls(&endpoint, &second.ca_pem, None).await?;
    stop.trigger();
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_a_client_without_a_certificate_is_refused() -> anyhow::Result<()> {
    init_logging();
    let folder = folder("mtls")?;
    let pki = new_pki("mutual")?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let config = server_tls(&cert, &key, &ca, Duration::from_secs(10));
    let stop = Shutdown::new();
    let endpoint = health_over_tls_server(&config, &stop).await?;
    assert!(
        health_over_tls(&endpoint, &pki.ca_pem, None).await.is_err(),
        "no client certificate"
    );
    let stranger = new_pki("stranger")?;
    assert!(
        health_over_tls(&endpoint, &pki.ca_pem, Some((&stranger.cert_pem, &stranger.key_pem)))
            .await
            .is_err(),
        "a client certificate of another CA"
    );
    health_over_tls(&endpoint, &pki.ca_pem, Some((&pki.cert_pem, &pki.key_pem))).await?;
    stop.trigger();
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

/// Settings that do not load are refused at startup, naming the setting:
/// a server never falls back to plaintext.
#[test]
fn a_configured_certificate_that_does_not_load_is_an_error_naming_the_setting() {
    let config = sluice_common::tls::TlsConfig {
        cert_file: "/nonexistent/tls.crt".to_string(),
        key_file: "/nonexistent/tls.key".to_string(),
        client_ca_file: String::new(),
        ca_file: String::new(),
        server_name: String::new(),
        reload_interval: sluice_common::config::HumanDuration(Duration::from_secs(10)),
    };
    let error = sluice_common::tls::ServerTls::load(&config)
        .err()
        .map(|error| error.to_string());
    assert!(
        error.as_deref().is_some_and(|error| error.contains("tls.cert_file")),
        "{error:?}"
    );
    let half = sluice_common::tls::TlsConfig {
        key_file: String::new(),
        ..config
    };
    assert!(
        sluice_common::tls::ServerTls::load(&half).is_err(),
        "half a pair is refused"
    );
}

/// Client files that are not PEM are refused when they are configured,
/// naming the setting, not at the first connection.
#[test]
fn client_files_that_are_not_pem_are_refused_naming_the_setting() -> anyhow::Result<()> {
    let folder = folder("badclient")?;
    let garbage = folder.join("garbage.pem");
    std::fs::write(&garbage, b"not a pem\0\xff")?;
    let garbage = garbage.to_string_lossy().into_owned();
    let error = sluice_common::tls::configure_client_files(Some(&garbage), None, None)
        .err()
        .map(|error| error.to_string());
    assert!(
        error.as_deref().is_some_and(|error| error.contains("tls.ca_file")),
        "{error:?}"
    );
    let pki = new_pki("goodca")?;
    let (cert, _, ca) = write_pki(&folder, &pki)?;
    let error = sluice_common::tls::configure_client_files(Some(&ca), Some((&cert, &garbage)), None)
        .err()
        .map(|error| error.to_string());
    assert!(
        error.as_deref().is_some_and(|error| error.contains("tls.key_file")),
        "{error:?}"
    );
    sluice_common::tls::configure_client_files(Some(&ca), None, None)?;
    std::fs::remove_dir_all(folder)?;
    Ok(())
}
