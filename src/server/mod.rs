//! Wiring: opens the store, starts the worker and both listeners, and stops them on request.

pub mod demo;
pub(crate) mod notify;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, Admin};
use crate::config::Config;
use crate::domain::clock::{self, SharedClock, Turns};
use crate::edge::body::BodyBudget;
use crate::edge::tls::Certificates;
use crate::edge::{self, process, ListenerLimits};
use crate::ingress::reader::Records;
use crate::ingress::{self, Ingress};
use crate::runtime::switches::{self, Switches};
use crate::runtime::Live;
use crate::store::{self, LeaseClock, StoreError};
use crate::upkeep;
use crate::upkeep::reload::Reloader;
use crate::upstream::Upstream;
use crate::worker::{self, Settled, Worker};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Said once, with the setting that named the address and what to do: the cause is in the
    /// message, not repeated as a source.
    #[error("cannot listen on {addr} ({setting}): {}", bind_failure(cause))]
    Bind { addr: SocketAddr, setting: &'static str, cause: std::io::Error },
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
    /// Set when the node starts leaving: `/readyz` fails from then on.
    leaving: admin::Leaving,
    /// The data plane's bound address (useful when the config asked for port 0).
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub worker: Worker,
    /// Reads the config file again and applies it (`SIGHUP`, `POST /admin/config/reload`).
    pub reloader: Arc<Reloader>,
    /// Where the routes' replays and 409s are flushed once more at shutdown, so that the last
    /// second's are not lost.
    store: Arc<dyn store::Store>,
    /// The time they are counted at.
    clock: SharedClock,
    /// `[server] drain` is read from it when the shutdown starts.
    live: Arc<Live>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    upkeep: Upkeep,
}

/// The background loops every node runs, each under its name, each taking its turns from
/// `stopping`: one that ends before shutdown (none should) is logged by name, and shutdown ends
/// them all between two turns and waits for them.
struct Upkeep {
    stopping: watch::Sender<bool>,
    loops: Vec<(&'static str, JoinHandle<()>)>,
}

impl Upkeep {
    fn new() -> Upkeep {
        Upkeep { stopping: watch::channel(false).0, loops: Vec::new() }
    }

    /// Runs the loop `work` makes of its turns.
    fn start<F>(&mut self, name: &'static str, work: impl FnOnce(Turns) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let turns = Turns::until(self.stopping.subscribe());
        let work = work(turns.clone());
        let task = tokio::spawn(async move {
            work.await;
            if !turns.over() {
                tracing::error!(task = name, "a background task ended before shutdown");
            }
        });
        self.loops.push((name, task));
    }

    /// Ends every loop after its turn in progress, waiting for it until `deadline`: one that
    /// is still busy then is cut where it waits.
    async fn stop(self, deadline: tokio::time::Instant) {
        let _ = self.stopping.send(true);
        for (name, mut task) in self.loops {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!(task = name, "a background task did not end its turn in time");
                task.abort();
            }
        }
    }
}

/// The data listener's setting, and the admin listener's, as an error names them.
pub(crate) const LISTEN: &str = "`server.listen`, or `--listen` for `idem demo`";
pub(crate) const ADMIN_LISTEN: &str = "`server.admin_listen`, or `--admin-listen` for `idem demo`";

async fn bind(addr: SocketAddr, setting: &'static str) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|cause| StartError::Bind { addr, setting, cause })
}

/// Why an address could not be listened on, and what to do.
fn bind_failure(cause: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let remedy = match cause.kind() {
        ErrorKind::AddrInUse => "another process listens there: stop it, or give another address",
        ErrorKind::AddrNotAvailable => "no interface of this host has that address: give one it has, or 0.0.0.0",
        ErrorKind::PermissionDenied => "a port below 1024 needs CAP_NET_BIND_SERVICE: give a higher one, or grant it",
        _ => return cause.to_string(),
    };
    format!("{cause}; {remedy}")
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
    crate::observe::metrics::handle();
    let live = Arc::new(Live::new(config, clock.clone()));
    // The settings a reload cannot change are read here, once.
    let config = live.current();
    let (data_limits, admin_limits) = listener_limits(&config);
    let data = bind(config.server.listen, LISTEN).await?;
    let admin_listener = bind(config.server.admin_listen, ADMIN_LISTEN).await?;
    let certificates = Certificates::load(&config)?;
    let store = store::open_synced(&config.store.url, config.store.sync, leases).await?;
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
    let data_tls = certificates.data.as_ref().map(|certificate| certificate.acceptor());
    let admin_tls = certificates.admin.as_ref().map(|certificate| certificate.acceptor());
    let reloader = Arc::new(Reloader::new(file, live.clone(), certificates, upstream.clone()));

    let ingress = Arc::new(Ingress::new(ingress::Parts {
        config: live.clone(),
        records: Records::new(store.clone(), clock.clone()),
        worker: worker.clone(),
        upstream: upstream.clone(),
        bodies: bodies.clone(),
        health: health.clone(),
        switches: switches.clone(),
        clock: clock.clone(),
        replay_cache_bytes: REPLAY_CACHE_BYTES,
    }));
    let leaving = admin::Leaving::default();
    let admin = Arc::new(Admin::new(admin::Parts {
        config: live.clone(),
        reloader: reloader.clone(),
        store: store.clone(),
        worker: worker.clone(),
        bodies,
        switches: switches.clone(),
        clock: clock.clone(),
        leaving: leaving.clone(),
    }));

    let (stop, stopped) = watch::channel(false);
    let listen =
        data.local_addr().map_err(|cause| StartError::Bind { addr: config.server.listen, setting: LISTEN, cause })?;
    let admin_listen = admin_listener.local_addr().map_err(|cause| StartError::Bind {
        addr: config.server.admin_listen,
        setting: ADMIN_LISTEN,
        cause,
    })?;
    let servers = vec![
        tokio::spawn(edge::serve(data, ingress::data_plane(ingress), data_limits, data_tls, stopped.clone())),
        tokio::spawn(edge::serve(admin_listener, admin::router(admin), admin_limits, admin_tls, stopped)),
    ];
    let mut loops = Upkeep::new();
    loops.start("retention sweep", |t| upkeep::retention_sweep(store.clone(), live.clone(), clock.clone(), t));
    loops.start("take-over sweep", |t| {
        upkeep::take_overs(store.clone(), worker.clone(), live.clone(), clock.clone(), t)
    });
    loops.start("probes", |t| upkeep::probes(store.clone(), upstream, live.clone(), worker.clone(), clock.clone(), t));
    loops.start("store health", |t| store::watch_store(store.clone(), health, t));
    loops.start("answer counts", |t| upkeep::tally::flush_every_second(live.clone(), store.clone(), clock.clone(), t));
    loops.start("canary watch", |t| {
        upkeep::canaries::watch(store.clone(), live.clone(), switches.clone(), clock.clone(), t)
    });
    loops.start("switch refresh", |t| switches::keep_fresh(switches, store.clone(), t));
    loops.start("metrics upkeep", crate::observe::metrics::upkeep);
    // Other nodes sharing the store announce the records they settle: wake our waiters.
    if let Some(mut notices) = store.notices() {
        let worker = worker.clone();
        loops.start("store notices", |mut turns| async move {
            while let Some(notice) = turns.next(notices.recv()).await {
                match notice {
                    Ok(store::Notice::Settled(id)) => worker.settled(id),
                    Ok(store::Notice::Queued(id)) => worker.offer(id),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
    }
    tracing::info!(
        version = crate::observe::metrics::VERSION,
        commit = crate::observe::metrics::COMMIT,
        %listen,
        %admin_listen,
        node = worker.owner(),
        instance = crate::observe::telemetry::instance_id(),
        "idem is serving"
    );
    Ok(Running { listen, admin_listen, worker, reloader, store, clock, live, leaving, stop, servers, upkeep: loops })
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
    /// Leaves in the order a load balancer needs: `/readyz` fails at once, for `[server]
    /// drain_readiness`, while requests are still served, so that the balancer stops sending
    /// new ones; then the listeners close and the drain begins ([`Running::shutdown`]).
    pub async fn leave(self) {
        let readiness = self.live.current().server.drain_readiness;
        if !readiness.is_zero() {
            tracing::info!(?readiness, "leaving: /readyz fails from now on; the listeners close after it");
            self.leaving.start(readiness);
            tokio::time::sleep(readiness).await;
        }
        self.shutdown().await;
    }

    /// Graceful shutdown: stops accepting connections, hands back records waiting between
    /// attempts, gives attempts in flight up to `[server] drain` to finish and be stored, lets
    /// their answers go out, and stops background upkeep.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        // One bound for the whole shutdown, not one per step.
        let drain = self.live.current().server.drain;
        let deadline = tokio::time::Instant::now() + drain;
        self.upkeep.stop(deadline).await;
        self.worker.shutdown(drain).await;
        for server in self.servers {
            if tokio::time::timeout_at(deadline, server).await.is_err() {
                tracing::warn!("a listener did not finish its answers in time");
            }
        }
        if let Err(e) = upkeep::tally::flush(&self.live.served(), &*self.store, self.clock.now()).await {
            tracing::warn!(error = %e, "the last replay and 409 counts could not be stored");
        }
        self.store.close().await;
    }
}

/// How the process was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// Ctrl-C (SIGINT): a person at a terminal, who wants it gone now.
    Interrupt,
    /// SIGTERM: a service manager or an orchestrator, behind which a load balancer may still
    /// send requests: the node leaves in its order ([`Running::leave`]).
    Terminate,
}

/// Runs a broker on `config`, read from `file`, until `shutdown` resolves; each `SIGHUP` reads
/// the file again and applies it (or keeps the running configuration and logs why).
pub async fn serve(
    config: Config,
    file: PathBuf,
    shutdown: impl Future<Output = Termination>,
) -> Result<(), StartError> {
    let mut running = start_reloadable(config, file).await?;
    #[cfg(unix)]
    {
        let reloader = running.reloader.clone();
        running.upkeep.start("reload on SIGHUP", |turns| reloader.on_hangup(turns));
    }
    crate::server::notify::ready();
    let how = shutdown.await;
    tracing::info!(?how, "shutting down");
    crate::server::notify::stopping();
    match how {
        Termination::Terminate => running.leave().await,
        Termination::Interrupt => running.shutdown().await,
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM, saying which.
pub async fn termination() -> Termination {
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
        _ = ctrl_c => Termination::Interrupt,
        _ = term => Termination::Terminate,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::*;

    /// A loop whose turns each take `work` after a 1 s wait, counting the turns it finished;
    /// `started` is told when a turn begins.
    fn counting(upkeep: &mut Upkeep, work: Duration) -> (Arc<AtomicU32>, Arc<Notify>) {
        let (finished, started) = (Arc::new(AtomicU32::new(0)), Arc::new(Notify::new()));
        let (done, begun) = (finished.clone(), started.clone());
        upkeep.start("counting", |mut turns| async move {
            while turns.next(tokio::time::sleep(Duration::from_secs(1))).await.is_some() {
                begun.notify_one();
                tokio::time::sleep(work).await;
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
        (finished, started)
    }

    /// A loop whose turns take `work`, told to stop within `bound` once its first turn began:
    /// the turns it finished, and how long the stop took.
    async fn stopped_mid_turn(work: Duration, bound: Duration) -> (u32, Duration) {
        let mut upkeep = Upkeep::new();
        let (finished, started) = counting(&mut upkeep, work);
        started.notified().await;
        let asked = tokio::time::Instant::now();
        upkeep.stop(asked + bound).await;
        (finished.load(Ordering::SeqCst), asked.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn a_shutdown_lets_each_loop_finish_its_turn_and_start_no_other() {
        let (finished, took) = stopped_mid_turn(Duration::from_secs(5), Duration::from_secs(60)).await;
        assert_eq!(finished, 1, "the turn in progress was cut, or another began");
        assert_eq!(took, Duration::from_secs(5), "the stop did not wait for the turn alone");
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_longer_than_the_shutdown_allows_is_cut_at_its_bound() {
        let (finished, took) = stopped_mid_turn(Duration::from_secs(600), Duration::from_secs(10)).await;
        assert_eq!((finished, took), (0, Duration::from_secs(10)));
    }
}
