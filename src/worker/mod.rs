//! The worker: admits a new request (or sheds it), claims a queued record, executes it under its
//! deadline, and stores every attempt and the outcome. An execution outlives the client's
//! request: run on the request's own task while its client waits for the outcome, it is handed
//! to a task of its own when the client stops waiting, so a client that disconnects does not
//! cancel it. No database transaction is ever held across an upstream call.
//!
//! Its parts, by job:
//! - `admission` — the one call the ingress makes ([`Worker::admit`]): shed or record a new
//!   request, and start its execution (claimed in the same commit when a worker is free).
//! - `awaited` — an execution whose client waits ([`Awaited`]): run on the client's task until
//!   it is told, the rest handed to a task of its own.
//! - each route's runtime (`crate::runtime`) — what a route and its upstream can take: slots,
//!   attempts in flight, the retry budget and the breaker; and the pace of its attempts.
//! - `execution` — one execution from its claim to its settlement; `attempts` — the loop of
//!   attempts and waits between them, each attempt sent within its send window; `pause` — the
//!   waits, with the lease kept alive through them; `lease` — a claim's lease as this process
//!   holds it: trusted for `lease - clock_margin`, renewed beside each attempt.
//! - `drain` — executions in flight, counted for a graceful shutdown.
//! - `waiters` — requests waiting for a record to settle; `credentials` — client credentials
//!   held in memory until their execution starts.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tracing::{info_span, Instrument};

use crate::domain::clock::SharedClock;
use crate::domain::Owner;
use crate::domain::Phase;
use crate::domain::RecordId;
use crate::domain::StopReason;
use crate::domain::Timestamp;
use crate::observe::metrics::Laps;
use crate::record::{HistoryEntry, Record, StoredResponse};
use crate::runtime::switches::Switches;
use crate::runtime::Live;
use crate::runtime::ServedRoute;
use crate::store::{Action, Cancel, Cancelled, Resolution, Resolve, Retry, Store, StoreError};
use crate::upstream::Upstream;

/// What the request that started an execution is told when it ends, or, for a streamed answer,
/// at its first body byte.
#[derive(Debug)]
pub enum Outcome {
    /// `done`: the stored response. `stop` is `deadline` when it arrived too late for the client.
    Done(StopReason, StoredResponse),
    /// `unknown`: it may have executed; it waits for reconciliation.
    Unknown(StopReason),
    /// The key is free again: nothing executed (or the route is replay-safe).
    Free {
        stop: StopReason,
        /// The last upstream answer, if any attempt got one.
        last: Option<StoredResponse>,
        /// Why the last attempt could not reach the upstream, if it could not: the route and
        /// the kind of failure, for the client's answer.
        unreachable: Option<String>,
    },
    /// This worker lost the record (claimed elsewhere, or cancelled before it started): the
    /// record in the store is the answer.
    Lost,
    /// How the execution ended, which the store could not take yet: it is written again until
    /// it does. Told to the client as it is, marked as not recorded.
    Unrecorded(Box<Outcome>),
    /// The upstream's answer streams (docs/concepts.md): its head, and its body as it arrives. The
    /// execution goes on reading it to its end and settles the record whatever the client does.
    Streaming(Streamed),
}

/// A streamed answer as its first client gets it.
pub struct Streamed {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub event_stream: bool,
    pub reader: crate::stream::Reader,
}

impl std::fmt::Debug for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamed").field("status", &self.status).field("event_stream", &self.event_stream).finish()
    }
}

/// A streamed answer in flight: its head, and the tap its body flows through.
#[derive(Clone)]
pub(super) struct Flow {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    pub(super) event_stream: bool,
    pub(super) tap: Arc<crate::stream::Tap>,
}

impl Flow {
    /// A reader from the first byte, while the body is still kept whole.
    fn attach(&self) -> Option<Streamed> {
        let reader = self.tap.attach()?;
        Some(Streamed { status: self.status, headers: self.headers.clone(), event_stream: self.event_stream, reader })
    }
}

/// The streamed answers in flight here, by record: a duplicate that waits attaches to one.
#[derive(Default)]
struct Streams(Mutex<HashMap<RecordId, Flow>>);

impl Streams {
    fn insert(&self, id: RecordId, flow: Flow) {
        lock(&self.0).insert(id, flow);
    }

    fn remove(&self, id: RecordId) {
        lock(&self.0).remove(&id);
    }

    fn get(&self, id: RecordId) -> Option<Flow> {
        lock(&self.0).get(&id).cloned()
    }

    fn contains(&self, id: RecordId) -> bool {
        lock(&self.0).contains_key(&id)
    }
}

/// What the request waiting for an execution is told: the outcome and, for a new key timed
/// stage by stage, its stages up to the outcome's commit. The request records them with the
/// whole way once its answer is built (`Laps::answered`), so every stage counts the requests
/// that were answered, and only those.
#[derive(Debug)]
pub struct Told {
    pub outcome: Outcome,
    pub laps: Option<Laps>,
    /// The attempts the record has had when it was told, this execution's and any before it.
    pub attempts: u32,
}

/// The request waiting for an execution, told once: at a streamed answer's first byte, or when
/// the execution ends. Held by the execution alone, and told only from it ([`Awaited`] reads
/// the outcome right after each poll of the execution, without waiting on the channel).
#[derive(Default)]
pub(super) struct Reply {
    to: Mutex<Option<oneshot::Sender<Told>>>,
    /// The new key's stages, kept by the execution when its outcome is stored and told with
    /// that outcome.
    laps: Mutex<Option<Laps>>,
    /// The number of the last attempt started.
    attempts: std::sync::atomic::AtomicU32,
}

impl Reply {
    fn to(reply: Option<oneshot::Sender<Told>>) -> Reply {
        Reply { to: Mutex::new(reply), laps: Mutex::default(), attempts: Default::default() }
    }

    /// The stages of the execution's new key, up to its outcome's commit: told with the outcome.
    pub(super) fn keep_stages(&self, laps: Laps) {
        *lock(&self.laps) = Some(laps);
    }

    /// Attempt `number` is starting.
    pub(super) fn attempted(&self, number: u32) {
        self.attempts.store(number, Ordering::Relaxed);
    }

    pub(super) fn send(&self, outcome: Outcome) {
        if let Some(reply) = lock(&self.to).take() {
            let attempts = self.attempts.load(Ordering::Relaxed);
            let _ = reply.send(Told { outcome, laps: lock(&self.laps).take(), attempts });
        }
    }
}

mod admission;
mod attempts;
mod awaited;
mod credentials;
mod drain;
mod execution;
#[cfg(test)]
mod fencing_tests;
mod in_doubt;
mod job;
mod lease;
mod running;
mod streaming;
mod unrecorded;

mod pause;
mod waiters;

pub(crate) use crate::runtime::{Refusal, Slot};
use admission::Start;
pub use admission::{Admitted, Request, Submission};
pub use awaited::Awaited;
use credentials::HeldCredentials;
use drain::Drain;
use running::Running;
pub use waiters::Settled;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One of the worker's executions, free and set aside ([`Worker::free_workers`]).
pub struct FreeWorker(OwnedSemaphorePermit);

#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

/// What a [`Worker`] is built on: the parts of the broker it shares with the others.
pub struct Parts {
    pub store: Arc<dyn Store>,
    pub upstream: Upstream,
    /// What is served: the configuration and its routes' runtimes. An execution takes its
    /// route from it once, when it starts, and keeps it to its end.
    pub config: Arc<Live>,
    /// This process's name in leases.
    pub owner: String,
    pub settled: Arc<Settled>,
    pub switches: Arc<Switches>,
    /// What time it is: for leases, attempt stamps, deadlines and `Retry-After` dates.
    pub clock: SharedClock,
}

struct Inner {
    store: Arc<dyn Store>,
    upstream: Upstream,
    /// What is served: the configuration and its routes' runtimes. An execution takes its
    /// route from it once, when it starts, and keeps it to its end.
    config: Arc<Live>,
    /// `worker.lease`, fixed for the life of the process (a reload cannot change it).
    lease: Duration,
    /// `worker.send_window`: an attempt's first byte leaves within this of its mark, or never.
    send_window: Duration,
    /// `worker.clock_margin`: a lease is trusted for `lease - clock_margin`.
    clock_margin: Duration,
    /// This process's name in leases.
    owner: Owner,
    /// At most `worker.concurrency` records execute at once.
    permits: Arc<Semaphore>,
    settled: Arc<Settled>,
    /// The operator's emergency switches: asked before every attempt and after it ends.
    switches: Arc<Switches>,
    clock: SharedClock,
    /// The `Authorization` of clients whose route forwards it, by record (`None`: the client
    /// sent none): held in memory only, from admission until the execution starts, never stored.
    credentials: HeldCredentials,
    /// The execution running here for each record, by the claim it runs under: at most one.
    running: Running,
    /// Streamed answers in flight here, by record: a duplicate that waits attaches to one.
    streams: Streams,
    /// Queued records this process will claim itself once a worker is free: offers of them
    /// (announced to every node, this one included) are declined here.
    mine: Mutex<HashSet<RecordId>>,
    /// Executions in flight, and the shutdown they drain for.
    drain: Drain,
    /// Outcomes the store could not take, being written again (see `unrecorded`).
    unrecorded: Arc<AtomicUsize>,
}

impl Inner {
    /// `record`'s route as it is served now, with a place on it for an execution that did not
    /// come through the ingress (a take-over, an operator's retry, a queued record): counted,
    /// never refused. `None` when the route is no longer configured.
    fn route_of(&self, record: &Record) -> Option<(ServedRoute, Slot)> {
        let route = self.config.served().route_named(&record.route)?;
        let slot = route.slot();
        Some((route, slot))
    }
}

impl Worker {
    pub fn new(parts: Parts) -> Worker {
        let Parts { store, upstream, config, owner, settled, switches, clock } = parts;
        let current = config.current();
        Worker {
            inner: Arc::new(Inner {
                permits: Arc::new(Semaphore::new(current.worker.concurrency)),
                lease: current.worker.lease,
                send_window: current.worker.send_window,
                clock_margin: current.worker.clock_margin,
                credentials: HeldCredentials::default(),
                mine: Mutex::new(HashSet::new()),
                drain: Drain::default(),
                store,
                upstream,
                config,
                owner: owner.into(),
                settled,
                switches,
                clock,
                running: Running::default(),
                streams: Streams::default(),
                unrecorded: Arc::default(),
            }),
        }
    }

    /// A worker named `owner` on `store`, serving `config` on `clock`, with a client and
    /// switches of its own: a node as the crate's tests make one.
    #[cfg(test)]
    pub(crate) fn on(store: Arc<dyn Store>, config: crate::config::Config, owner: &str, clock: SharedClock) -> Worker {
        Worker::new(Parts {
            store,
            upstream: Upstream::new(),
            config: Arc::new(Live::new(config, clock.clone())),
            owner: owner.into(),
            settled: Arc::new(Settled::default()),
            switches: Arc::new(Switches::new(clock.clone())),
            clock,
        })
    }

    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Outcomes the store could not take when they came, still being written again: each is an
    /// execution whose client was answered but whose record does not show it yet.
    pub fn unrecorded_outcomes(&self) -> usize {
        self.inner.unrecorded.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Executes a queued record in the background (an operator's retry, a queued record found
    /// unclaimed). It takes a place on its route, counted but never refused.
    pub fn submit(&self, record: Record) {
        let route = self.inner.route_of(&record);
        lock(&self.inner.mine).insert(record.id);
        self.spawn(Arc::new(record), route, Start::Claim);
    }

    /// Sets aside up to `most` of the workers free right now, for records about to be claimed
    /// in bulk: a record is claimed only with a worker in hand, so no lease runs out while its
    /// record waits for one. Those not used go back when dropped.
    pub fn free_workers(&self, most: usize) -> Vec<FreeWorker> {
        std::iter::from_fn(|| self.inner.permits.clone().try_acquire_owned().ok().map(FreeWorker)).take(most).collect()
    }

    /// Workers free right now.
    pub fn idle_workers(&self) -> usize {
        self.inner.permits.available_permits()
    }

    /// Executes, on the worker set aside for it, a record this process just claimed (a queued
    /// record nobody claimed) by a write sent at `claimed`.
    pub fn resume(&self, record: Record, worker: FreeWorker, claimed: crate::domain::clock::Moment) {
        let route = self.inner.route_of(&record);
        self.spawn(Arc::new(record), route, Start::Claimed { worker: worker.0, granted: claimed });
    }

    /// Runs `record` on `route` as it is served now (`None`: the route is no longer configured),
    /// its place on the route held to the end, on a task of its own: nobody waits for it.
    fn spawn(&self, record: Arc<Record>, route: Option<(ServedRoute, Slot)>, start: Start) {
        tokio::spawn(self.execution(record, route, None, start));
    }

    /// Runs `record` as [`Worker::spawn`] does, for a client that waits for the outcome: on the
    /// task that awaits it, until the outcome is told (see `awaited`).
    fn awaited(&self, record: Arc<Record>, route: Option<(ServedRoute, Slot)>, start: Start) -> Awaited {
        let (reply, told) = oneshot::channel();
        Awaited::new(told, Box::pin(self.execution(record, route, Some(reply), start)))
    }

    /// The execution of `record` on `route`, which tells `reply` its outcome: run to its end on
    /// whichever task polls it, in its own span.
    fn execution(
        &self,
        record: Arc<Record>,
        route: Option<(ServedRoute, Slot)>,
        reply: Option<oneshot::Sender<Told>>,
        start: Start,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let inner = self.inner.clone();
        let span = info_span!(
            "execution",
            record = %record.id,
            tenant = %record.tenant,
            key = %record.key,
            route = %record.route
        );
        // Counted from here, so a shutdown (or anyone waiting for the node to be idle) sees an
        // execution that has not been polled yet.
        let running = inner.drain.running();
        async move {
            let _running = running;
            let reply = Reply::to(reply);
            let Some(outcome) = inner.execute(&record, route, start, &reply).await else { return };
            reply.send(outcome);
        }
        .instrument(span)
    }

    /// Graceful shutdown: no attempt starts from now on and waits end at once, handing their
    /// records back to the queue; attempts in flight get up to `bound` to finish and be stored.
    pub async fn shutdown(&self, bound: Duration) {
        self.inner.drain.shutdown(bound).await;
    }

    /// Another process queued a record: with a worker free here, try to claim and run it. Of
    /// every node offered it, one claims it; the others find it claimed and let it go.
    pub fn offer(&self, id: RecordId) {
        if lock(&self.inner.mine).contains(&id) {
            return;
        }
        let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else { return };
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(Some(record)) = inner.store.get(id).await else { return };
            if record.phase() != Phase::Queued {
                return;
            }
            let route = inner.route_of(&record);
            let _running = inner.drain.running();
            inner.claim_and_run(&record, route.as_ref().map(|(route, _)| route), &Reply::default()).await;
        });
    }

    /// Resolves once no execution runs in this process (none may start meanwhile for it to be
    /// final: a test that holds every other way in waits for its executions to end).
    pub async fn idle(&self) {
        self.inner.drain.until_idle().await;
    }

    /// Becomes true when the process begins to shut down.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.inner.drain.stopping()
    }

    /// Wakes requests waiting for a record that was settled outside a worker.
    pub fn settled(&self, id: RecordId) {
        self.inner.settled.settled(id);
    }

    /// Tells when `id` is settled, by this process or, through the store's notices, another.
    pub fn watch(&self, id: RecordId) -> Arc<tokio::sync::Notify> {
        self.inner.settled.watch(id)
    }

    /// A reader of `id`'s answer, if it is streaming through this process and still kept whole:
    /// what a duplicate that waits gets instead of a 409 (docs/concepts.md).
    pub fn attach(&self, id: RecordId) -> Option<Streamed> {
        let flow = self.inner.streams.get(id);
        flow?.attach()
    }

    /// Whether `id`'s answer is streaming through this process.
    pub fn streaming(&self, id: RecordId) -> bool {
        self.inner.streams.contains(id)
    }

    /// Settles an `unknown` record as an operator says (`entry`), and wakes whoever waits for it.
    pub async fn resolve_record(
        &self,
        id: RecordId,
        resolution: Resolution,
        entry: HistoryEntry,
    ) -> Result<Action, StoreError> {
        let action = self.inner.store.resolve(Resolve { id, resolution, entry }).await?;
        action.applied().inspect(|record| self.settled(record.id));
        Ok(action)
    }

    /// Queues an `unknown` record again, to end by `deadline_at`, as an operator says (`entry`),
    /// and takes it up.
    pub async fn retry_record(
        &self,
        id: RecordId,
        deadline_at: Timestamp,
        entry: HistoryEntry,
    ) -> Result<Action, StoreError> {
        let action = self.inner.store.retry(Retry { id, deadline_at, entry }).await?;
        action.applied().inspect(|record| self.submit((*record).clone()));
        Ok(action)
    }

    /// Cancels `id` for whoever `entry` names (a client, an operator): a queued record at once,
    /// its waiters woken; a running one when its worker next looks (docs/concepts.md).
    pub async fn cancel_record(&self, id: RecordId, entry: HistoryEntry) -> Result<Cancelled, StoreError> {
        let cancelled = self.inner.store.cancel(Cancel { id, entry }).await?;
        match &cancelled {
            Cancelled::Dequeued(record) => self.settled(record.id),
            Cancelled::Flagged(record) => self.cancel(record.id),
            Cancelled::Refused(_) | Cancelled::Missing => {}
        }
        Ok(cancelled)
    }

    /// Stops an execution running here: no further attempt starts; one in flight finishes.
    fn cancel(&self, id: RecordId) {
        if let Some(s) = self.inner.running.signal(id) {
            s.raised.store(true, Ordering::SeqCst);
            s.notify.notify_waiters();
        }
    }
}
