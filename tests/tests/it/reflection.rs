//! gRPC reflection can be turned off (`process.grpc_reflection`); health
//! always stays open for probes.

use std::time::Duration;

use sluice_common::Shutdown;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::ServerReflectionRequest;

/// A server with base routes only; returns its endpoint and its health.
async fn server_with(
    reflection: bool,
    limits: sluice_common::grpc::ServerLimits,
    stop: &Shutdown,
) -> anyhow::Result<(String, sluice_common::grpc::Health)> {
    let listener = sluice_common::grpc::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let (routes, health) = sluice_common::grpc::base_routes(vec!["sluice.v1.Admission"], reflection)?;
    health.set_serving(true).await;
    tokio::spawn(sluice_common::grpc::serve(listener, routes, None, limits, stop.clone()));
    Ok((endpoint, health))
}

fn default_limits() -> anyhow::Result<sluice_common::grpc::ServerLimits> {
    let defaults = sluice_common::SluiceConfig::load_with(None, &[])?;
    Ok(sluice_common::grpc::ServerLimits::of(&defaults.process))
}

async fn server(reflection: bool, stop: &Shutdown) -> anyhow::Result<String> {
    Ok(server_with(reflection, default_limits()?, stop).await?.0)
}

/// `process.grpc_request_timeout` bounds a call's time to its response; a
/// stream (as workers' `Work` and the owners' links are) stays open past it
/// and keeps delivering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_timeout_does_not_cut_an_open_stream() -> anyhow::Result<()> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};
    let stop = Shutdown::new();
    let limits = sluice_common::grpc::ServerLimits {
        request_timeout: Duration::from_millis(200),
        max_concurrent_requests: 4,
    };
    let (endpoint, health) = server_with(false, limits, &stop).await?;
    let mut client = HealthClient::new(sluice_e2e::connect(&endpoint).await?);
    let mut watch = client
        .watch(HealthCheckRequest { service: String::new() })
        .await?
        .into_inner();
    let first = watch.message().await?.map(|answer| answer.status);
    assert_eq!(first, Some(ServingStatus::Serving as i32));
    // Five request timeouts later, the stream still delivers a change.
    tokio::time::sleep(Duration::from_secs(1)).await;
    health.set_serving(false).await;
    let next = tokio::time::timeout(Duration::from_secs(10), watch.message()).await??;
    assert_eq!(next.map(|answer| answer.status), Some(ServingStatus::NotServing as i32));
    // Unary calls are answered as before.
    let checked = client.check(HealthCheckRequest { service: String::new() }).await?;
    assert_eq!(checked.into_inner().status, ServingStatus::NotServing as i32);
    stop.trigger();
    Ok(())
}

/// The services reflection lists, or the call's status code.
async fn list_services(endpoint: &str) -> anyhow::Result<Result<Vec<String>, tonic::Code>> {
    let channel = sluice_e2e::connect(endpoint).await?;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let answer = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter(vec![request]))
        .await;
    let mut stream = match answer {
        Ok(response) => response.into_inner(),
        Err(status) => return Ok(Err(status.code())),
    };
    let first = match tokio::time::timeout(Duration::from_secs(10), stream.message()).await? {
        Ok(first) => first,
        Err(status) => return Ok(Err(status.code())),
    };
    let services = match first.and_then(|response| response.message_response) {
        Some(tonic_reflection::pb::v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|service| service.name).collect()
        }
        other => anyhow::bail!("unexpected reflection answer {other:?}"),
    };
    Ok(Ok(services))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_can_be_turned_off_and_health_stays_open() -> anyhow::Result<()> {
    let stop = Shutdown::new();
    let on = server(true, &stop).await?;
    let listed = list_services(&on).await?;
    assert!(
        listed
            .as_ref()
            .is_ok_and(|services| services.iter().any(|name| name == "sluice.v1.Admission")),
        "{listed:?}"
    );
    let off = server(false, &stop).await?;
    assert_eq!(list_services(&off).await?, Err(tonic::Code::Unimplemented));
    assert!(
        sluice_e2e::health_serving(&off).await?,
        "health answers with reflection off"
    );
    stop.trigger();
    Ok(())
}
