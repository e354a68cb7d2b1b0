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

    /// Trigger on SIGTERM or SIGINT; exit the process on a second signal.
    pub fn trigger_on_signals(&self) {
        let shutdown = self.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutdown signal received, draining (send again to exit now)");
            shutdown.trigger();
            wait_for_signal().await;
            tracing::warn!("second shutdown signal, exiting now");
            std::process::exit(130);
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
