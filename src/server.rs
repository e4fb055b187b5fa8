//! Wiring: opens the store, starts the worker and both listeners, and stops them on request.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, Admin};
use crate::canary;
use crate::clock::{self, SharedClock};
use crate::config::{Config, Live};
use crate::edge::body::BodyBudget;
use crate::edge::tls::Certificates;
use crate::edge::{self, process, ListenerLimits};
use crate::ingress::{self, Ingress};
use crate::reconcile;
use crate::records::Records;
use crate::reload::Reloader;
use crate::runtime::Runtimes;
use crate::store::{self, LeaseClock, StoreError};
use crate::switchboard::{self, Switches};
use crate::tally;
use crate::upstream::Upstream;
use crate::worker::{self, Settled, Worker};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A listener's certificate, read when the configuration was, cannot be read again.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// Memory for done answers kept for replays.
const REPLAY_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// A running broker. Dropping it does not stop it; call [`Running::shutdown`].
pub struct Running {
    /// The data plane's bound address (useful when the config asked for port 0).
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub worker: Worker,
    /// Reads the config file again and applies it (`SIGHUP`, `POST /admin/config/reload`).
    pub reloader: Arc<Reloader>,
    /// Their replays and 409s are flushed once more at shutdown, so the last second's are not lost.
    runtimes: Arc<Runtimes>,
    /// Where those last counts go.
    store: Arc<dyn store::Store>,
    /// The time they are counted at.
    clock: SharedClock,
    /// `[server] drain` is read from it when the shutdown starts.
    live: Arc<Live>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    upkeep: Upkeep,
}

/// The background loops every node runs, each under its name: one that ends before shutdown
/// (none should) is logged by name, and shutdown stops them all.
#[derive(Default)]
struct Upkeep {
    loops: Vec<(&'static str, JoinHandle<()>)>,
}

impl Upkeep {
    fn start(&mut self, name: &'static str, work: impl std::future::Future<Output = ()> + Send + 'static) {
        let task = tokio::spawn(async move {
            work.await;
            tracing::error!(task = name, "a background task ended before shutdown");
        });
        self.loops.push((name, task));
    }

    fn stop(&self) {
        for (_, task) in &self.loops {
            task.abort();
        }
    }
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

/// Starts a broker on `config`, which it cannot reload: there is no file to read again.
pub async fn start(config: Config) -> Result<Running, StartError> {
    start_on(config, None, clock::system(), LeaseClock::Database).await
}

/// Starts a broker on `config`, read from `file`, which a reload reads again.
pub async fn start_reloadable(config: Config, file: PathBuf) -> Result<Running, StartError> {
    start_on(config, Some(file), clock::system(), LeaseClock::Database).await
}

/// Starts a broker that reads the time from `clock` (a test's [`clock::ManualClock`], say)
/// wherever it stamps, compares or computes a time, its store's leases included; `file`, if
/// given, is what a reload reads. Waiting is still done on tokio's timer.
pub async fn start_with_clock(
    config: Config,
    file: Option<PathBuf>,
    clock: SharedClock,
) -> Result<Running, StartError> {
    start_on(config, file, clock, LeaseClock::Node).await
}

async fn start_on(
    config: Config,
    file: Option<PathBuf>,
    clock: SharedClock,
    leases: LeaseClock,
) -> Result<Running, StartError> {
    crate::metrics::handle();
    let live = Arc::new(Live::new(config));
    // The settings a reload cannot change are read here, once.
    let config = live.current();
    let (data_limits, admin_limits) = listener_limits(&config);
    let data = bind(config.server.listen).await?;
    let admin_listener = bind(config.server.admin_listen).await?;
    let certificates = Certificates::load(&config)?;
    let store = store::open_with(&config.store.url, leases).await?;
    let settled = Arc::new(Settled::default());
    let health = Arc::new(store::Health::default());
    // Read before the first request: a restarted node obeys the switches left on at once.
    let switches = Arc::new(Switches::new(clock.clone()));
    switches.refresh(&*store).await?;
    // One client, so one connection pool per upstream, for the ingress's plain proxying, the
    // worker's attempts and the probes.
    let upstream = Upstream::new();
    let worker = Worker::new(worker::Parts {
        store: store.clone(),
        upstream: upstream.clone(),
        config: live.clone(),
        owner: node_name(),
        settled: settled.clone(),
        switches: switches.clone(),
        clock: clock.clone(),
    });
    let bodies = Arc::new(BodyBudget::new(config.server.limits.max_buffered_bodies));
    let runtimes = worker.runtimes();
    let data_tls = certificates.data.as_ref().map(|certificate| certificate.acceptor());
    let admin_tls = certificates.admin.as_ref().map(|certificate| certificate.acceptor());
    let reloader = Arc::new(Reloader::new(file, live.clone(), worker.clone(), certificates, upstream.clone()));

    let ingress = Arc::new(Ingress::new(ingress::Parts {
        config: live.clone(),
        records: Records::new(store.clone(), live.clone(), clock.clone()),
        worker: worker.clone(),
        upstream: upstream.clone(),
        bodies: bodies.clone(),
        health: health.clone(),
        switches: switches.clone(),
        clock: clock.clone(),
        replay_cache_bytes: REPLAY_CACHE_BYTES,
    }));
    let admin = Arc::new(Admin::new(admin::Parts {
        config: live.clone(),
        reloader: reloader.clone(),
        store: store.clone(),
        worker: worker.clone(),
        bodies,
        switches: switches.clone(),
        clock: clock.clone(),
    }));

    let (stop, stopped) = watch::channel(false);
    let listen = data.local_addr().map_err(|source| StartError::Bind { addr: config.server.listen, source })?;
    let admin_listen =
        admin_listener.local_addr().map_err(|source| StartError::Bind { addr: config.server.admin_listen, source })?;
    let servers = vec![
        tokio::spawn(edge::serve(data, ingress::router(ingress), data_limits, data_tls, stopped.clone())),
        tokio::spawn(edge::serve(admin_listener, admin::router(admin), admin_limits, admin_tls, stopped)),
    ];
    let mut upkeep = Upkeep::default();
    upkeep.start("retention sweep", reconcile::retention_sweep(store.clone(), live.clone(), clock.clone()));
    upkeep.start("take-over sweep", reconcile::take_overs(store.clone(), worker.clone(), live.clone(), clock.clone()));
    upkeep.start("probes", reconcile::probes(store.clone(), upstream, live.clone(), worker.clone(), clock.clone()));
    upkeep.start("store health", store::watch_store(store.clone(), health));
    upkeep.start("answer counts", tally::flush_every_second(runtimes.clone(), store.clone(), clock.clone()));
    upkeep.start("canary watch", canary::watch(store.clone(), live.clone(), switches.clone(), clock.clone()));
    upkeep.start("switch refresh", switchboard::keep_fresh(switches, store.clone()));
    // Other nodes sharing the store announce the records they settle: wake our waiters.
    if let Some(mut notices) = store.notices() {
        let worker = worker.clone();
        upkeep.start("store notices", async move {
            loop {
                match notices.recv().await {
                    Ok(store::Notice::Settled(id)) => worker.settled(id),
                    Ok(store::Notice::Queued(id)) => worker.offer(id),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
    }
    tracing::info!(%listen, %admin_listen, node = worker.owner(), "idem is serving");
    Ok(Running { listen, admin_listen, worker, reloader, runtimes, store, clock, live, stop, servers, upkeep })
}

/// Each listener's connection budget and timeouts. The open-file limit is raised first, so that
/// the data listener's default budget is derived from the limit in force.
fn listener_limits(config: &Config) -> (ListenerLimits, ListenerLimits) {
    let limits = &config.server.limits;
    let open_files = match process::raise_open_file_limit() {
        Ok(files) => {
            tracing::info!(soft = files.soft_before, hard = files.hard, now = files.soft, "open-file limit");
            Some(files.soft)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-file limit");
            None
        }
    };
    let admin_connections = limits.admin_max_connections;
    let data_connections = match (limits.max_connections, open_files) {
        (Some(n), _) => n,
        (None, Some(files)) => process::derived_max_connections(files, admin_connections),
        (None, None) => process::derived_max_connections(1024, admin_connections),
    };
    if let Some(files) = open_files.filter(|files| !process::fits(data_connections, admin_connections, *files)) {
        tracing::warn!(
            max_connections = data_connections,
            open_files = files,
            "server.max_connections is more than the open-file limit allows (two files per request in flight): \
             accepts and upstream calls may fail before it is reached"
        );
    }
    tracing::info!(data = data_connections, admin = admin_connections, "connection budgets");
    let listener = |name, max_connections| ListenerLimits {
        name,
        max_connections,
        header_timeout: limits.header_timeout,
        body_timeout: limits.body_timeout,
    };
    (listener("data", data_connections), listener("admin", admin_connections))
}

impl Running {
    /// Graceful shutdown: stops accepting connections, hands back records waiting between
    /// attempts, gives attempts in flight up to `[server] drain` to finish and be stored, lets
    /// their answers go out, and stops background upkeep.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.upkeep.stop();
        // One bound for the whole shutdown, not one per step.
        let drain = self.live.current().server.drain;
        let deadline = tokio::time::Instant::now() + drain;
        self.worker.shutdown(drain).await;
        for server in self.servers {
            if tokio::time::timeout_at(deadline, server).await.is_err() {
                tracing::warn!("a listener did not finish its answers in time");
            }
        }
        if let Err(e) = tally::flush(&self.runtimes, &*self.store, self.clock.now()).await {
            tracing::warn!(error = %e, "the last replay and 409 counts could not be stored");
        }
    }
}

/// Runs a broker on `config`, read from `file`, until `shutdown` resolves; each `SIGHUP` reads
/// the file again and applies it (or keeps the running configuration and logs why).
pub async fn serve(config: Config, file: PathBuf, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let running = start_reloadable(config, file).await?;
    #[cfg(unix)]
    let hangups = tokio::spawn(running.reloader.clone().on_hangup());
    shutdown.await;
    #[cfg(unix)]
    hangups.abort();
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
