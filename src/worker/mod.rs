//! The worker: claims a queued record, executes it under its deadline, and stores every attempt
//! and the outcome. It runs apart from the client's request, so a client that disconnects does
//! not cancel an execution, and no database transaction is ever held across an upstream call.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{oneshot, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::{info_span, warn, Instrument};
use uuid::Uuid;

use crate::config::{Config, Live, Policy, Route};
use crate::metrics;
use crate::policy::{self, Class, Decision, Ended, Execution, Observed, Pace, Settlement, StopReason};
use crate::record::Owner;
use crate::record::{duration_ms, now_ms, Attempt, Millis, Phase, Record, StoredResponse};
use crate::store::{self, AttemptEnded, AttemptStarted, Claim, ClaimQueued, Lease, Renew, Store};
use crate::switchboard::Switches;
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

mod credentials;
mod guards;
mod run;
mod settled;

use credentials::HeldCredentials;
pub use guards::{Guards, Refusal, Slot};
use run::Running;
pub use settled::Settled;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker and a place among a route's attempts, set aside for an execution that starts at once.
pub struct Reservation {
    worker: OwnedSemaphorePermit,
    attempt: OwnedSemaphorePermit,
    /// The configuration the admission was read under: the record is claimed, and its first
    /// attempt marked, with its route's policy, so the execution keeps that one.
    config: Arc<Config>,
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
    /// The configuration in force; an execution reads it once, when it starts.
    config: Arc<Live>,
    /// `worker.lease`, fixed for the life of the process (a reload cannot change it).
    lease: Duration,
    /// This process's name in leases.
    owner: Owner,
    /// At most `worker.concurrency` records execute at once.
    permits: Arc<Semaphore>,
    settled: Arc<Settled>,
    guards: Arc<Guards>,
    /// The operator's emergency switches: asked before every attempt and after it ends.
    switches: Arc<Switches>,
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

impl Worker {
    pub fn new(
        store: Arc<dyn Store>,
        upstream: Upstream,
        config: Arc<Live>,
        owner: String,
        settled: Arc<Settled>,
        switches: Arc<Switches>,
    ) -> Worker {
        let current = config.current();
        Worker {
            inner: Arc::new(Inner {
                permits: Arc::new(Semaphore::new(current.worker.concurrency)),
                guards: Arc::new(Guards::new(&current)),
                lease: current.worker.lease,
                pace: Pace::default(),
                credentials: Mutex::new(HeldCredentials::default()),
                stopping: watch::channel(false).0,
                mine: Mutex::new(HashSet::new()),
                active: AtomicUsize::new(0),
                idle: Notify::new(),
                store,
                upstream,
                config,
                owner: owner.into(),
                settled,
                switches,
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
    /// `config` is the configuration the request was read under, which the execution keeps.
    pub fn reserve(&self, config: &Arc<Config>, route: &Route) -> Option<Reservation> {
        let worker = self.inner.permits.clone().try_acquire_owned().ok()?;
        let attempt = self.inner.guards.route(route).attempts.clone().try_acquire_owned().ok()?;
        Some(Reservation { worker, attempt, config: config.clone() })
    }

    /// The policy a request of `tenant` with `key` runs under on `route`: the route's own, or the
    /// canary's for a request in the slice of a canary that no `canary_off` switch has ended.
    pub fn policy<'r>(&self, route: &'r Route, tenant: &str, key: &str) -> Policy<'r> {
        self.inner.policy(route, tenant, key)
    }

    /// The claim that a reserved admission writes: this process's lease, starting `now`, and
    /// the version of the policy its first attempt is sent under (chosen by [`Worker::policy`]).
    pub fn claim(&self, now: Millis, policy: &Policy<'_>) -> Claim {
        Claim {
            owner: self.inner.owner.clone(),
            lease_until: self.inner.lease_until(now),
            policy_version: policy.version.clone(),
        }
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
                    Start::Reserved(Reservation { worker, attempt, config }) => {
                        let _permit = worker;
                        inner.run(record, Some((attempt, config))).await
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
