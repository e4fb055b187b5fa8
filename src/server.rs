//! Wiring: opens the store, starts the worker and both listeners, and stops them on request.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, Admin};
use crate::config::Config;
use crate::ingress::{self, Ingress, Replays};
use crate::reconcile;
use crate::store::{self, StoreError};
use crate::tally::{self, Tally};
use crate::upstream::Upstream;
use crate::worker::{Settled, Worker};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Memory for done answers kept for replays.
const REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// How long a shutdown waits for attempts in flight.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(10);

/// A running broker. Dropping it does not stop it; call [`Running::shutdown`].
pub struct Running {
    /// The data plane's bound address (useful when the config asked for port 0).
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub worker: Worker,
    /// Flushed once more at shutdown, so the last second's replays and 409s are not lost.
    tally: Arc<Tally>,
    /// Where those last counts go.
    store: Arc<dyn store::Store>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    upkeep: Vec<JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { addr, source })
}

/// A name for this process in leases: unique even for two processes with the same pid.
fn node_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "idem".into());
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &nonce[..8])
}

pub async fn start(config: Config) -> Result<Running, StartError> {
    let config = Arc::new(config);
    crate::metrics::handle();
    let data = bind(config.server.listen).await?;
    let admin_listener = bind(config.server.admin_listen).await?;
    let store = store::open(&config.store.url).await?;
    let settled = Arc::new(Settled::default());
    let worker = Worker::new(store.clone(), config.clone(), node_name(), settled.clone());
    let tally = Arc::new(Tally::new(config.routes.iter().map(|r| r.name.as_str())));

    let ingress = Arc::new(Ingress {
        config: config.clone(),
        store: store.clone(),
        worker: worker.clone(),
        settled: settled.clone(),
        upstream: Upstream::new(),
        replays: Replays::new(REPLAY_CACHE_BYTES),
        tally: tally.clone(),
    });
    let admin = Arc::new(Admin { config: config.clone(), store: store.clone(), worker: worker.clone(), settled });

    let (stop, stopped) = watch::channel(false);
    let listen = data.local_addr().map_err(|source| StartError::Bind { addr: config.server.listen, source })?;
    let admin_listen =
        admin_listener.local_addr().map_err(|source| StartError::Bind { addr: config.server.admin_listen, source })?;
    let servers = vec![
        tokio::spawn(serve_until(data, ingress::router(ingress), stopped.clone())),
        tokio::spawn(serve_until(admin_listener, admin::router(admin), stopped)),
    ];
    let mut upkeep = vec![
        tokio::spawn(reconcile::retention_sweep(store.clone(), config.store.retention)),
        tokio::spawn(reconcile::take_overs(store.clone(), worker.clone(), config.clone())),
        tokio::spawn(reconcile::probes(store.clone(), config.clone(), worker.clone())),
        tokio::spawn(tally::flush_every_second(tally.clone(), store.clone())),
    ];
    // Other nodes sharing the store announce the records they settle: wake our waiters.
    if let Some(mut notices) = store.notices() {
        let worker = worker.clone();
        upkeep.push(tokio::spawn(async move {
            loop {
                match notices.recv().await {
                    Ok(store::Notice::Settled(id)) => worker.settled(id),
                    Ok(store::Notice::Queued(id)) => worker.offer(id),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        }));
    }
    tracing::info!(%listen, %admin_listen, node = worker.owner(), "idem is serving");
    Ok(Running { listen, admin_listen, worker, tally, store, stop, servers, upkeep })
}

async fn serve_until(listener: TcpListener, router: axum::Router, mut stopped: watch::Receiver<bool>) {
    let shutdown = async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    if let Err(e) = axum::serve(listener, router).with_graceful_shutdown(shutdown).await {
        tracing::error!(error = %e, "listener failed");
    }
}

impl Running {
    /// Graceful shutdown: stops accepting connections, hands back records waiting between
    /// attempts, gives attempts in flight up to `SHUTDOWN_BOUND` to finish and be stored, lets
    /// their answers go out, and stops background upkeep.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in &self.upkeep {
            task.abort();
        }
        // One bound for the whole shutdown, not one per step.
        let deadline = tokio::time::Instant::now() + SHUTDOWN_BOUND;
        self.worker.shutdown(SHUTDOWN_BOUND).await;
        for server in self.servers {
            if tokio::time::timeout_at(deadline, server).await.is_err() {
                tracing::warn!("a listener did not finish its answers in time");
            }
        }
        if let Err(e) = self.tally.flush(&*self.store).await {
            tracing::warn!(error = %e, "the last replay and 409 counts could not be stored");
        }
    }
}

/// Runs a broker until `shutdown` resolves.
pub async fn serve(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let running = start(config).await?;
    shutdown.await;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn termination() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
