//! refresh-dispatcher: the refresh schedule of floating concurrency keys. This first version answers gRPC health only; its
//! behaviour arrives with its own issue.

use std::sync::Arc;

use sluice_common::service::Supervisor;
use sluice_common::{grpc, Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

pub const SERVICE: &str = "refresh-dispatcher";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("refresh-dispatcher stopped: {0}")]
    Stopped(String),
}

/// Nothing to migrate yet.
pub async fn migrate(_config: &SluiceConfig) -> Result<(), ServiceError> {
    Ok(())
}

/// Run one instance until `shutdown`.
pub async fn run(
    _config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    _faults: Faults,
) -> Result<(), ServiceError> {
    let (routes, health) = grpc::base_routes(vec!["sluice.v1.Refresh"])?;
    let mut supervisor = Supervisor::new(shutdown.clone());
    supervisor.spawn("grpc server", grpc::serve(listener, routes, shutdown.clone()));
    health.set_serving(true).await;
    tracing::info!("refresh-dispatcher started");
    supervisor.wait().await.map_err(ServiceError::Stopped)
}
