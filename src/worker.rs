//! The worker: claims a queued record, executes it under its deadline, and stores every attempt
//! and the outcome. It runs apart from the client's request, so a client that disconnects does
//! not cancel an execution, and no database transaction is ever held across an upstream call.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{oneshot, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::{info_span, warn, Instrument};
use uuid::Uuid;

use crate::config::{Config, Route};
use crate::metrics;
use crate::policy::{
    self, Breaker, BreakerState, Class, Decision, Ended, Execution, Observed, Pace, RetryBudget, Settlement, StopReason,
};
use crate::record::{duration_ms, now_ms, Attempt, Millis, Phase, Record, StoredResponse};
use crate::store::{self, Claim, Lease, Store};
use crate::upstream::{self, Upstream};

/// What the request that started an execution is told when it ends.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// `done`: the stored response. `stop` is `deadline` when it arrived too late for the client.
    Done(StopReason, StoredResponse),
    /// `unknown`: it may have executed; it waits for reconciliation.
    Unknown(StopReason),
    /// The key is free again: nothing executed (or the route is replay-safe). `last` is the last
    /// upstream answer, if any attempt got one.
    Free(StopReason, Option<StoredResponse>),
    /// This worker lost the record (claimed elsewhere, cancelled before it started, or the store
    /// failed): the record in the store is the answer.
    Lost,
}

/// Wakes the requests that wait for a record to settle (`Prefer: wait`).
#[derive(Default)]
pub struct Settled {
    watchers: Mutex<HashMap<Uuid, Weak<Notify>>>,
}

impl Settled {
    pub fn watch(&self, id: Uuid) -> Arc<Notify> {
        let mut map = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = map.get(&id).and_then(Weak::upgrade) {
            return existing;
        }
        if map.len() > 1024 {
            map.retain(|_, w| w.strong_count() > 0);
        }
        let notify = Arc::new(Notify::new());
        map.insert(id, Arc::downgrade(&notify));
        notify
    }

    pub fn settled(&self, id: Uuid) {
        let watcher = self.watchers.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        if let Some(n) = watcher.and_then(|w| w.upgrade()) {
            n.notify_waiters();
        }
    }
}

/// The protections shared by the ingress and the workers: per route, a retry budget, a cap on
/// attempts in flight and a bound on executions waiting for one; per upstream, a breaker.
pub struct Guards {
    routes: HashMap<String, Arc<RouteGuard>>,
    breakers: HashMap<String, Mutex<Breaker>>,
}

struct RouteGuard {
    budget: Mutex<RetryBudget>,
    /// Attempts in flight on the route (`max_concurrency`).
    attempts: Arc<Semaphore>,
    /// Executions admitted and not finished: those in flight plus those queued behind them.
    pending: AtomicUsize,
    max_pending: usize,
}

/// An execution's place on its route; the route counts it until this is dropped.
pub struct Slot(Arc<RouteGuard>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why the ingress refuses to start an execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The route's attempts and its queue are full.
    Overloaded,
    /// The upstream's circuit is open; ask again after this long.
    CircuitOpen(Duration),
}

/// Executions may queue behind a full route up to a quarter of `max_concurrency` (at least 4).
fn queue_bound(max_concurrency: usize) -> usize {
    (max_concurrency / 4).max(4)
}

impl Guards {
    pub fn new(config: &Config) -> Guards {
        let now = Instant::now();
        let routes = config
            .routes
            .iter()
            .map(|r| {
                let guard = RouteGuard {
                    budget: Mutex::new(RetryBudget::new(r.retry.budget_ratio, r.retry.budget_min_per_sec, now)),
                    attempts: Arc::new(Semaphore::new(r.max_concurrency)),
                    pending: AtomicUsize::new(0),
                    max_pending: r.max_concurrency + queue_bound(r.max_concurrency),
                };
                (r.name.clone(), Arc::new(guard))
            })
            .collect();
        let mut breakers = HashMap::new();
        for r in &config.routes {
            breakers.entry(r.upstream.clone()).or_insert_with(|| Mutex::new(Breaker::new(r.circuit)));
        }
        Guards { routes, breakers }
    }

    /// Takes a place for a new execution on `route`, unless the route or its upstream must shed it.
    pub fn enter(&self, route: &Route) -> Result<Slot, Refusal> {
        if let Some(breaker) = self.breakers.get(&route.upstream) {
            lock(breaker).admit(Instant::now()).map_err(Refusal::CircuitOpen)?;
        }
        let guard = self.routes.get(&route.name).ok_or(Refusal::Overloaded)?;
        let before = guard.pending.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(guard.clone());
        if before >= guard.max_pending {
            return Err(Refusal::Overloaded);
        }
        Ok(slot)
    }

    /// A place for an execution that did not come through the ingress (take-over, operator
    /// retry): counted, never refused.
    pub fn slot(&self, route: &str) -> Option<Slot> {
        let guard = self.routes.get(route)?;
        guard.pending.fetch_add(1, Ordering::SeqCst);
        Some(Slot(guard.clone()))
    }

    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        let now = Instant::now();
        self.breakers.iter().map(|(u, b)| (u.clone(), lock(b).state(now))).collect()
    }

    fn circuit_open(&self, upstream: &str) -> bool {
        self.breakers.get(upstream).is_some_and(|b| lock(b).is_open(Instant::now()))
    }

    fn record_outcome(&self, upstream: &str, success: bool) {
        if let Some(b) = self.breakers.get(upstream) {
            lock(b).record(success, Instant::now());
        }
    }

    fn first_attempt(&self, route: &str) {
        if let Some(g) = self.routes.get(route) {
            lock(&g.budget).deposit(Instant::now());
        }
    }

    fn take_retry(&self, route: &str) -> bool {
        self.routes.get(route).is_some_and(|g| lock(&g.budget).try_withdraw(Instant::now()))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker and a place among a route's attempts, set aside for an execution that starts at once.
pub struct Reservation {
    worker: OwnedSemaphorePermit,
    attempt: OwnedSemaphorePermit,
}

enum Start {
    /// Queued: claim it first.
    Claim,
    /// Already claimed by this process (a take-over, an orphan).
    Claimed,
    /// Admitted claimed, first attempt marked, capacity in hand.
    Reserved(Reservation),
}

/// Lets a cancel reach an execution running in this process at once, even mid-wait.
#[derive(Default)]
struct CancelSignal {
    raised: AtomicBool,
    notify: Notify,
}

#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    upstream: Upstream,
    config: Arc<Config>,
    /// This process's name in leases.
    owner: String,
    /// At most `worker.concurrency` records execute at once.
    permits: Arc<Semaphore>,
    settled: Arc<Settled>,
    guards: Arc<Guards>,
    /// Each route's typical attempt duration, for the 409's estimate of when an outcome is due.
    pace: Pace,
    /// The `Authorization` of clients whose route forwards it, by record (`None`: the client
    /// sent none): held in memory only, from admission until the execution starts, never stored.
    credentials: Mutex<HeldCredentials>,
    cancels: Mutex<HashMap<Uuid, Arc<CancelSignal>>>,
    /// Queued records this process will claim itself once a worker is free: offers of them
    /// (announced to every node, this one included) are declined here.
    mine: Mutex<HashSet<Uuid>>,
    /// Set at shutdown: executions hand their records back instead of waiting or starting.
    stopping: watch::Sender<bool>,
    /// Executions running in this process, and a wake-up for when there are none.
    active: AtomicUsize,
    idle: Notify,
}

enum WaitEnd {
    Elapsed,
    Cancelled,
    /// The process is shutting down: hand the record back.
    Stopping,
    Lost,
}

/// Where an execution stands between attempts.
struct Progress {
    /// When the request arrived as its route's deadline counts: earlier than it did if the client
    /// shortened its deadline, so that the time left always ends at the record's `deadline_at`.
    arrival: Millis,
    /// The number of the last attempt stored with the record (all executions).
    number: u32,
    wait_before: Duration,
    /// What the policy's next decisions depend on: attempts made, the last wait, what they showed.
    run: Execution,
    /// The last attempt's response, if one came.
    last_response: Option<StoredResponse>,
}

impl Progress {
    fn new(record: &Record, deadline: Duration) -> Progress {
        let arrival = record.deadline_at - duration_ms(deadline);
        Progress {
            arrival,
            number: record.attempts.len() as u32,
            wait_before: Duration::ZERO,
            // Attempts an earlier worker made before a take-over count against `max_attempts`,
            // as the deadline they spent does.
            run: Execution::resumed(record.attempts.iter().filter(|a| a.started_at >= arrival).count() as u32),
            last_response: None,
        }
    }
}

/// Client credentials waiting for their execution to start. One whose record another node ran
/// is never taken: it is dropped once its deadline has passed.
#[derive(Default)]
struct HeldCredentials {
    by_record: HashMap<Uuid, (Option<http::HeaderValue>, Millis)>,
    /// Expired entries are swept when the map grows past this, which then doubles: amortised,
    /// a hold costs O(1).
    sweep_at: usize,
}

impl HeldCredentials {
    fn hold(&mut self, id: Uuid, credential: Option<http::HeaderValue>, deadline_at: Millis, now: Millis) {
        if self.by_record.len() >= self.sweep_at {
            self.by_record.retain(|_, (_, until)| *until > now);
            self.sweep_at = (2 * self.by_record.len()).max(256);
        }
        self.by_record.insert(id, (credential, deadline_at));
    }

    /// `None` when nothing is held: the request was received by another process.
    fn take(&mut self, id: Uuid) -> Option<Option<http::HeaderValue>> {
        self.by_record.remove(&id).map(|(credential, _)| credential)
    }
}

impl Worker {
    pub fn new(store: Arc<dyn Store>, config: Arc<Config>, owner: String, settled: Arc<Settled>) -> Worker {
        Worker {
            inner: Arc::new(Inner {
                permits: Arc::new(Semaphore::new(config.worker.concurrency)),
                guards: Arc::new(Guards::new(&config)),
                pace: Pace::default(),
                credentials: Mutex::new(HeldCredentials::default()),
                stopping: watch::channel(false).0,
                mine: Mutex::new(HashSet::new()),
                active: AtomicUsize::new(0),
                idle: Notify::new(),
                store,
                upstream: Upstream::new(),
                config,
                owner,
                settled,
                cancels: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    pub fn guards(&self) -> &Guards {
        &self.inner.guards
    }

    pub fn pace(&self) -> &Pace {
        &self.inner.pace
    }

    /// Keeps the client's credential for the execution of `id` that is about to start here.
    /// Useless after `deadline_at`, when no attempt can start any more.
    pub fn hold_credential(&self, id: Uuid, credential: Option<http::HeaderValue>, deadline_at: Millis) {
        lock(&self.inner.credentials).hold(id, credential, deadline_at, now_ms());
    }

    /// Executes a queued record in the background; `reply`, if given, gets the outcome.
    /// `slot` is the place the ingress took on the route; without one, one is taken here.
    pub fn submit(&self, record: Record, slot: Option<Slot>, reply: Option<oneshot::Sender<Outcome>>) {
        let slot = slot.or_else(|| self.inner.guards.slot(&record.route));
        lock(&self.inner.mine).insert(record.id);
        self.spawn(record, slot, reply, Start::Claim);
    }

    /// Executes a record this process already claimed (a take-over or an unclaimed record).
    pub fn resume(&self, record: Record) {
        let slot = self.inner.guards.slot(&record.route);
        self.spawn(record, slot, None, Start::Claimed);
    }

    /// Sets aside a worker and a place among `route`'s attempts for an execution that starts at
    /// once, if both are free right now. With it, the ingress records the request already claimed
    /// by this process, its first attempt marked as about to be sent, in one commit.
    pub fn reserve(&self, route: &str) -> Option<Reservation> {
        let worker = self.inner.permits.clone().try_acquire_owned().ok()?;
        let attempt = self.inner.guards.routes.get(route)?.attempts.clone().try_acquire_owned().ok()?;
        Some(Reservation { worker, attempt })
    }

    /// The claim that a reserved admission writes: this process's lease, starting `now`.
    pub fn claim(&self, now: Millis) -> Claim {
        Claim { owner: self.inner.owner.clone(), lease_until: self.inner.lease_until(now) }
    }

    /// Executes a record admitted with a reservation (see [`Worker::reserve`]).
    pub fn start(&self, record: Record, slot: Slot, reservation: Reservation, reply: Option<oneshot::Sender<Outcome>>) {
        self.spawn(record, Some(slot), reply, Start::Reserved(reservation));
    }

    fn spawn(&self, record: Record, slot: Option<Slot>, reply: Option<oneshot::Sender<Outcome>>, start: Start) {
        let inner = self.inner.clone();
        let span = info_span!(
            "execution",
            record = %record.id,
            tenant = %record.tenant,
            key = %record.key,
            route = %record.route
        );
        tokio::spawn(
            async move {
                let _slot = slot;
                let _running = Running::new(&inner);
                let outcome = match start {
                    Start::Reserved(Reservation { worker, attempt }) => {
                        let _permit = worker;
                        inner.run(record, Some(attempt)).await
                    }
                    Start::Claim | Start::Claimed => {
                        let Ok(_permit) = inner.permits.acquire().await else { return };
                        if matches!(start, Start::Claim) {
                            inner.claim_and_run(record).await
                        } else {
                            inner.run(record, None).await
                        }
                    }
                };
                if let Some(reply) = reply {
                    let _ = reply.send(outcome);
                }
            }
            .instrument(span),
        );
    }

    /// Graceful shutdown: no attempt starts from now on and waits end at once, handing their
    /// records back to the queue; attempts in flight get up to `bound` to finish and be stored.
    pub async fn shutdown(&self, bound: Duration) {
        let inner = &self.inner;
        inner.stopping.send_replace(true);
        let drained = async {
            loop {
                let idle = inner.idle.notified();
                tokio::pin!(idle);
                idle.as_mut().enable();
                if inner.active.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        };
        if tokio::time::timeout(bound, drained).await.is_err() {
            warn!(running = inner.active.load(Ordering::SeqCst), "shutdown bound reached with attempts in flight");
        }
    }

    /// Another process queued a record: with a worker free here, try to claim and run it. Of
    /// every node offered it, one claims it; the others find it claimed and let it go.
    pub fn offer(&self, id: Uuid) {
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
            let _slot = inner.guards.slot(&record.route);
            let _running = Running::new(&inner);
            inner.claim_and_run(record).await;
        });
    }

    /// Becomes true when the process begins to shut down.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.inner.stopping.subscribe()
    }

    /// Wakes requests waiting for a record that was settled outside a worker.
    pub fn settled(&self, id: Uuid) {
        self.inner.settled.settled(id);
    }

    /// Stops an execution running here: no further attempt starts; one in flight finishes.
    pub fn cancel(&self, id: Uuid) {
        let signal = self.inner.cancels.lock().unwrap_or_else(|p| p.into_inner()).get(&id).cloned();
        if let Some(s) = signal {
            s.raised.store(true, Ordering::SeqCst);
            s.notify.notify_waiters();
        }
    }
}

/// Counts a running execution for the shutdown drain.
struct Running<'a>(&'a Inner);

impl<'a> Running<'a> {
    fn new(inner: &'a Inner) -> Running<'a> {
        inner.active.fetch_add(1, Ordering::SeqCst);
        Running(inner)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Inner {
    fn stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    fn lease_until(&self, now: Millis) -> Millis {
        now + duration_ms(self.config.worker.lease)
    }

    async fn claim_and_run(&self, record: Record) -> Outcome {
        let now = now_ms();
        let claimed = self.store.claim(record.id, &self.owner, self.lease_until(now), now).await;
        lock(&self.mine).remove(&record.id);
        match claimed {
            Ok(true) => self.run(record, None).await,
            Ok(false) => Outcome::Lost,
            Err(e) => {
                warn!(error = %e, "could not claim a record; it stays queued");
                Outcome::Lost
            }
        }
    }

    /// Runs attempts until the policy stops, storing each attempt before and after it is sent.
    async fn run(&self, record: Record, reserved: Option<OwnedSemaphorePermit>) -> Outcome {
        let Some(route) = self.config.route_named(&record.route) else {
            warn!(route = %record.route, "the record's route is no longer configured");
            let progress = Progress::new(&record, Duration::ZERO);
            return self.finish(&record, false, None, StopReason::Cancelled, progress).await;
        };
        // Checked at ingress; only a route changed since then can make it fail here.
        let Ok(url) = route.upstream_url(&record.path, &record.query) else {
            warn!(route = %record.route, "the record's path would not reach the upstream as recorded; not sending it");
            let progress = Progress::new(&record, Duration::ZERO);
            return self.finish(&record, false, None, StopReason::Cancelled, progress).await;
        };
        let credential = lock(&self.credentials).take(record.id);
        let mut credentials = route.upstream_headers.clone();
        if route.forward_authorization {
            let Some(sent) = credential else {
                // Reached here, a record that is not replay-safe has had no attempt that may have
                // executed (a take-over makes those unknown), so settling frees it.
                warn!("the client's credential is not held by this process; not sending");
                let progress = Progress::new(&record, Duration::ZERO);
                return self
                    .finish(&record, route.replay_safe, None, StopReason::CredentialUnavailable, progress)
                    .await;
            };
            if let Some(credential) = sent {
                credentials.insert(http::header::AUTHORIZATION, credential);
            }
        }
        let signal = Arc::new(CancelSignal::default());
        lock(&self.cancels).insert(record.id, signal.clone());
        let outcome = self.attempts(&record, route, url, &credentials, &signal, reserved).await;
        lock(&self.cancels).remove(&record.id);
        outcome
    }

    async fn attempts(
        &self,
        record: &Record,
        route: &Route,
        url: reqwest::Url,
        credentials: &http::HeaderMap,
        signal: &CancelSignal,
        reserved: Option<OwnedSemaphorePermit>,
    ) -> Outcome {
        let policy = &route.retry;
        let mut p = Progress::new(record, policy.deadline);
        // Taken over (or handed back) in the middle of a wait: the rest of it is still owed.
        if let Some(not_before) = record.not_before {
            if let Some(rest) = Some(not_before - now_ms()).filter(|&ms| ms > 0) {
                match self.wait(record.id, Duration::from_millis(rest as u64), signal).await {
                    WaitEnd::Elapsed => {}
                    WaitEnd::Cancelled => {
                        return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                    }
                    WaitEnd::Stopping => return self.release(record).await,
                    WaitEnd::Lost => return Outcome::Lost,
                }
            }
            // The next attempt follows the whole wait, wherever it was spent: it is recorded as
            // such, and feeds decorrelated jitter as it would have.
            if let Some(last) = record.attempts.last() {
                let ended = last.started_at + last.duration_ms as Millis;
                let wait = Duration::from_millis((not_before - ended).max(0) as u64);
                p.wait_before = wait;
                p.run.waited(wait);
            }
        }
        let mut reserved = reserved;
        loop {
            // `marked`: admitted already claimed, with this first attempt marked as about to be
            // sent in the same commit, so nothing more is written before sending it.
            let (started, in_flight, marked) = match reserved.take() {
                Some(place) => (record.in_flight.map_or_else(now_ms, |(_, at)| at), Some(place), true),
                None => {
                    // A place among the route's attempts in flight, held for this attempt only.
                    let place = match self.guards.routes.get(&route.name) {
                        Some(g) => self.renewing(record.id, g.attempts.clone().acquire_owned()).await.ok(),
                        None => None,
                    };
                    (now_ms(), place, false)
                }
            };
            let cancelled = signal.raised.load(Ordering::SeqCst);
            let limit = match p.run.next_attempt(policy, since(p.arrival, started), cancelled) {
                Ok(limit) => limit,
                Err(stop) => return self.finish_after(record, route, None, stop, p).await,
            };
            if self.stopping() && !marked {
                return self.release(record).await;
            }
            let made = p.run.sending();
            p.number += 1;
            if !marked {
                match self
                    .store
                    .attempt_started(record.id, &self.owner, p.number, started, self.lease_until(started))
                    .await
                {
                    Ok(Lease::Held { cancel_requested: false }) => {}
                    Ok(Lease::Held { cancel_requested: true }) => {
                        return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                    }
                    Ok(Lease::Lost) => return Outcome::Lost,
                    Err(e) => {
                        // Without a durable "may have been sent" mark the attempt must not go out.
                        warn!(error = %e, "could not record an attempt; not sending it");
                        return Outcome::Lost;
                    }
                }
            }
            if made == 1 {
                self.guards.first_attempt(&route.name);
            }
            let mut told = credentials.clone();
            upstream::tell_deadline(&mut told, route.deadline_header.as_ref(), limit);
            let clock = Instant::now();
            let sent = self.upstream.send(
                &record.method,
                url.clone(),
                &record.request.headers,
                &told,
                record.request.body.clone(),
                limit,
            );
            let span = info_span!("attempt", number = p.number, wait_ms = p.wait_before.as_millis() as u64);
            let result = self.renewing(record.id, sent).instrument(span.clone()).await;
            let took = clock.elapsed();
            drop(in_flight);

            let (observed, answer) = match result {
                Ok(answer) => (Observed::Response(answer.response.status), Some(answer)),
                Err(observed) => (observed, None),
            };
            let retry_after = answer.as_ref().and_then(|a| a.retry_after.as_deref()).and_then(|value| {
                let parsed = policy::parse_retry_after(value, SystemTime::now());
                if parsed.is_none() {
                    warn!(value, "ignoring an unparseable Retry-After from the upstream");
                }
                parsed
            });
            let (class, decision) = p.run.ended(
                policy,
                route.replay_safe,
                Ended {
                    observed,
                    retry_after,
                    elapsed: since(p.arrival, now_ms()),
                    cancelled: signal.raised.load(Ordering::SeqCst),
                    circuit_open: self.guards.circuit_open(&route.upstream),
                },
                rand::random::<f64>,
                || self.guards.take_retry(&route.name),
            );
            let attempt = Attempt {
                number: p.number,
                started_at: started,
                duration_ms: took.as_millis() as u64,
                outcome: class.as_str().to_string(),
                status: answer.as_ref().map(|a| a.response.status),
                error: match observed {
                    Observed::Response(_) => None,
                    Observed::ConnectFailed => Some("connect_failed".into()),
                    Observed::TimedOut => Some("timed_out".into()),
                    Observed::Broken => Some("broken".into()),
                },
                wait_ms: p.wait_before.as_millis() as u64,
            };
            span.in_scope(|| {
                tracing::info!(
                    attempt = p.number,
                    outcome = class.as_str(),
                    status = attempt.status,
                    took_ms = attempt.duration_ms,
                    wait_ms = attempt.wait_ms,
                    "attempt"
                )
            });
            metrics::attempt(&route.name, class, took);
            self.pace.observe(&route.name, took);
            p.last_response = answer.map(|a| a.response);

            let wait = match decision {
                Decision::Stop(stop) => return self.finish_after(record, route, Some(attempt), stop, p).await,
                Decision::RetryAfter(wait) => wait,
            };
            let now = now_ms();
            let then = store::AfterAttempt::Wait { not_before: now + duration_ms(wait) };
            match self.store.attempt_ended(record.id, &self.owner, Some(attempt), then, now).await {
                Ok(Lease::Held { cancel_requested: false }) => {}
                Ok(Lease::Held { cancel_requested: true }) => {
                    return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                }
                Ok(Lease::Lost) => return Outcome::Lost,
                Err(e) => {
                    warn!(error = %e, "could not record an attempt's outcome");
                    return Outcome::Lost;
                }
            }
            match self.wait(record.id, wait, signal).await {
                WaitEnd::Elapsed => {}
                WaitEnd::Cancelled => return self.finish_after(record, route, None, StopReason::Cancelled, p).await,
                WaitEnd::Stopping => return self.release(record).await,
                WaitEnd::Lost => return Outcome::Lost,
            }
            p.run.waited(wait);
            p.wait_before = wait;
        }
    }

    /// Hands a record back to the queue at shutdown, between attempts, for another worker (or
    /// this node after its restart) to continue within the same deadline.
    async fn release(&self, record: &Record) -> Outcome {
        match self.store.attempt_ended(record.id, &self.owner, None, store::AfterAttempt::Release, now_ms()).await {
            Ok(_) => tracing::info!(record = %record.id, "handed back at shutdown"),
            Err(e) => warn!(error = %e, "could not hand a record back; its lease will expire"),
        }
        Outcome::Lost
    }

    async fn finish_after(
        &self,
        record: &Record,
        route: &Route,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> Outcome {
        // The breaker hears the request's logical outcome, once: did the upstream serve it?
        if let (true, Some(class)) = (stop != StopReason::Cancelled, p.run.last()) {
            let served = matches!(class, Class::Success | Class::Final)
                && p.last_response.as_ref().is_some_and(|r| r.status < 500);
            self.guards.record_outcome(&route.upstream, served);
        }
        metrics::stopped(&route.name, stop, p.run.attempts(), since(p.arrival, now_ms()));
        self.finish(record, route.replay_safe, attempt, stop, p).await
    }

    async fn finish(
        &self,
        record: &Record,
        replay_safe: bool,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> Outcome {
        let (then, outcome) = match (p.run.settle(stop, replay_safe), p.last_response) {
            (Settlement::Done, Some(response)) => {
                (store::AfterAttempt::Done(stop, response.clone()), Outcome::Done(stop, response))
            }
            (Settlement::Free, last) => (store::AfterAttempt::Free(stop), Outcome::Free(stop, last)),
            // `Done` always comes with the response that made it so; should it ever not, the
            // safe reading of an execution we cannot show is "unknown".
            (Settlement::Unknown, _) | (Settlement::Done, None) => {
                (store::AfterAttempt::Unknown(stop), Outcome::Unknown(stop))
            }
        };
        let result = self.store.attempt_ended(record.id, &self.owner, attempt, then, now_ms()).await;
        self.settled.settled(record.id);
        match result {
            Ok(Lease::Held { .. }) => {
                tracing::info!(stop = stop.as_str(), "settled");
                outcome
            }
            Ok(Lease::Lost) => Outcome::Lost,
            Err(e) => {
                warn!(error = %e, "could not store an outcome; the lease will expire and be taken over");
                Outcome::Lost
            }
        }
    }

    /// Awaits an attempt while keeping the lease alive.
    async fn renewing<F: Future>(&self, id: Uuid, attempt: F) -> F::Output {
        tokio::pin!(attempt);
        let every = self.config.worker.lease / 3;
        loop {
            tokio::select! {
                out = &mut attempt => return out,
                _ = tokio::time::sleep(every) => {
                    let now = now_ms();
                    if let Ok(Lease::Lost) = self.store.renew(id, &self.owner, self.lease_until(now), now).await {
                        warn!("lost the lease while an attempt was in flight");
                    }
                }
            }
        }
    }

    /// Sleeps before a retry, renewing the lease, and stops at once on a cancel.
    async fn wait(&self, id: Uuid, total: Duration, signal: &CancelSignal) -> WaitEnd {
        let until = tokio::time::Instant::now() + total;
        let slice = self.config.worker.lease / 3;
        let mut stopping = self.stopping.subscribe();
        loop {
            if *stopping.borrow_and_update() {
                return WaitEnd::Stopping;
            }
            let notified = signal.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if signal.raised.load(Ordering::SeqCst) {
                return WaitEnd::Cancelled;
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return WaitEnd::Elapsed;
            }
            tokio::select! {
                _ = tokio::time::sleep((until - now).min(slice)) => {}
                _ = &mut notified => return WaitEnd::Cancelled,
                _ = stopping.changed() => return WaitEnd::Stopping,
            }
            if tokio::time::Instant::now() < until {
                let now = now_ms();
                match self.store.renew(id, &self.owner, self.lease_until(now), now).await {
                    Ok(Lease::Held { cancel_requested: true }) => return WaitEnd::Cancelled,
                    Ok(Lease::Lost) => return WaitEnd::Lost,
                    _ => {}
                }
            }
        }
    }
}

fn since(arrival: Millis, now: Millis) -> Duration {
    Duration::from_millis((now - arrival).max(0) as u64)
}
