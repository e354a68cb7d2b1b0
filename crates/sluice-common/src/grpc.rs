//! gRPC bootstrap: the standard health service (readiness follows the
//! service's own state), reflection over every Sluice proto, graceful
//! shutdown, and a listener passed in so tests bind 127.0.0.1:0.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tonic::service::RoutesBuilder;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::shutdown::Shutdown;

#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("cannot bind {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reflection setup failed: {0}")]
    Reflection(String),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthError),
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Bind a listener for `address` (e.g. "0.0.0.0:50051", "127.0.0.1:0").
pub async fn bind(address: &str) -> Result<TcpListener, GrpcError> {
    TcpListener::bind(address).await.map_err(|source| GrpcError::Bind {
        address: address.to_string(),
        source,
    })
}

/// The health service name liveness probes ask for.
pub const LIVENESS_SERVICE: &str = "liveness";

/// Reports serving status for the whole server ("") and each named service.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    services: Vec<&'static str>,
}

impl Health {
    /// Readiness: "" and each named service. The `liveness` service stays
    /// SERVING while the process runs (an owner rebuilding is not dead).
    pub async fn set_serving(&self, serving: bool) {
        self.reporter
            .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
            .await;
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status("", status).await;
        for service in &self.services {
            self.reporter.set_service_status(*service, status).await;
        }
    }
}

/// Routes with health (and reflection, when `reflection`) already added,
/// plus the health handle. `services` are the fully qualified names
/// reported by health (e.g. "sluice.v1.Admission").
pub fn base_routes(services: Vec<&'static str>, reflection: bool) -> Result<(RoutesBuilder, Health), GrpcError> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let mut routes = RoutesBuilder::default();
    routes.add_service(health_service);
    if reflection {
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|error| GrpcError::Reflection(error.to_string()))?;
        routes.add_service(reflection);
    }
    Ok((routes, Health { reporter, services }))
}

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How much one gRPC server takes on (`process.grpc_*`).
#[derive(Clone, Copy, Debug)]
pub struct ServerLimits {
    /// A call's longest time to its response (a stream's: to its opening).
    pub request_timeout: std::time::Duration,
    /// Calls served at once per connection.
    pub max_concurrent_requests: usize,
}

impl ServerLimits {
    pub fn of(config: &crate::config::ProcessConfig) -> Self {
        ServerLimits {
            request_timeout: config.grpc_request_timeout.0,
            max_concurrent_requests: config.grpc_max_concurrent_requests.max(1),
        }
    }
}

/// Serve until `shutdown` (graceful: in-flight calls finish); over TLS when
/// `tls` is set (its certificate reloaded while serving). Each call is
/// bounded by `limits`.
pub async fn serve(
    listener: TcpListener,
    routes: RoutesBuilder,
    tls: Option<std::sync::Arc<crate::tls::ServerTls>>,
    limits: ServerLimits,
    shutdown: Shutdown,
) -> Result<(), GrpcError> {
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(address = ?local, tls = tls.is_some(), "gRPC server listening");
    // Without TCP_NODELAY a small write behind one the peer has not
    // acknowledged waits for its delayed ACK (40 ms on Linux): a stream's
    // push or grant right after another would pay it every time.
    let accepted = tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(listener), |accepted| {
        accepted.inspect(|stream| {
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%error, "could not set TCP_NODELAY on a gRPC connection");
            }
        })
    });
    let server = tonic::transport::Server::builder()
        .timeout(limits.request_timeout)
        .concurrency_limit_per_connection(limits.max_concurrent_requests)
        .add_routes(routes.routes());
    let stop = shutdown.clone();
    match tls {
        None => {
            server
                .serve_with_incoming_shutdown(accepted, async move { stop.cancelled().await })
                .await?
        }
        Some(tls) => {
            tokio::spawn(tls.clone().watch(shutdown.clone()));
            let handshaken = handshakes(accepted, tls, shutdown.clone());
            server
                .serve_with_incoming_shutdown(handshaken, async move { stop.cancelled().await })
                .await?
        }
    }
    Ok(())
}

/// TLS connections from accepted TCP ones, each handshake in a task of its
/// own (a slow or silent client holds up no one else), bounded in time. A
/// failed handshake (a plaintext client, an untrusted client certificate)
/// is logged and the connection dropped.
fn handshakes(
    accepted: impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static,
    tls: std::sync::Arc<crate::tls::ServerTls>,
    shutdown: Shutdown,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>> {
    let (sender, receiver) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut accepted = std::pin::pin!(accepted);
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return,
                next = tokio_stream::StreamExt::next(&mut accepted) => next,
            };
            let stream = match next {
                Some(Ok(stream)) => stream,
                Some(Err(error)) => {
                    tracing::debug!(%error, "accepting a gRPC connection failed");
                    continue;
                }
                None => return,
            };
            let peer = stream.peer_addr().ok();
            let acceptor = tls.acceptor();
            let sender = sender.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        let _ = sender.send(Ok(tls_stream)).await;
                    }
                    Ok(Err(error)) => tracing::info!(?peer, %error, "TLS handshake refused"),
                    Err(_) => tracing::info!(?peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}
