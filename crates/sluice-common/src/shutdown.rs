//! One shutdown token per service instance. SIGTERM/SIGINT start a drain; a
//! second signal exits at once. A crash (a fault hook, or a task that failed)
//! cancels the same token without draining.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    token: CancellationToken,
    crashed: Arc<AtomicBool>,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// A token cancelled with this one (and cancellable on its own).
    pub fn child(&self) -> Shutdown {
        Shutdown {
            token: self.token.child_token(),
            crashed: self.crashed.clone(),
        }
    }

    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Start a graceful drain.
    pub fn trigger(&self) {
        self.token.cancel();
    }

    /// Stop at once, skipping every flush: what a killed process would do.
    pub fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
        self.token.cancel();
    }

    pub fn is_crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    pub fn is_triggered(&self) -> bool {
        self.token.is_cancelled()
    }

    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// Trigger on SIGTERM or SIGINT; exit the process on a second signal, or
    /// with status 1 when the drain takes longer than `drain_timeout` (a
    /// broker or database that never answers must not keep a pod
    /// terminating for ever).
    pub fn trigger_on_signals(&self, drain_timeout: std::time::Duration) {
        let shutdown = self.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!(
                ?drain_timeout,
                "shutdown signal received, draining (send again to exit now)"
            );
            shutdown.trigger();
            tokio::select! {
                _ = wait_for_signal() => {
                    tracing::warn!("second shutdown signal, exiting now");
                    std::process::exit(130);
                }
                _ = tokio::time::sleep(drain_timeout) => {
                    tracing::error!(?drain_timeout, "the drain did not finish within process.drain_timeout; exiting");
                    std::process::exit(1);
                }
            }
        });
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM, only ctrl-c stops the service");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
