//! Admission: the one call the ingress makes into the worker. A new request is shed before
//! anything is recorded when its route is saturated, its upstream's circuit is open or an
//! operator isolated it; else it is recorded and its execution starts. With a worker and a place
//! among the route's attempts free right now, the record is inserted already claimed by this
//! process, its first attempt marked as about to be sent: one commit before the send, not three.
//! The execution runs on the request's own task while its client waits for the outcome, and is
//! handed to a task of its own when the client stops waiting (`awaited`); an execution nobody
//! waits for is spawned at once.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{lock, Awaited, Inner, Refusal, Worker};
use crate::config::{Config, Policy, Route};
use crate::domain::fingerprint::Fingerprint;
use crate::domain::key::IdempotencyKey;
use crate::domain::{Arrival, Phase, RecordId, State, Tenant, Timestamp};
use crate::observe::metrics::{Laps, Stage};
use crate::record::{Record, StoredRequest};
use crate::runtime::{RouteGuard, ServedRoute};
use crate::store::{self, Admission, Claim, NewRecord, StoreError};

/// A new request, as the ingress read it, asking to be executed.
pub struct Submission<'a> {
    /// The route as the request was read under: an execution that starts at once keeps it.
    pub route: &'a ServedRoute,
    /// The policy chosen for it (see [`crate::runtime::switches::Switches::policy`]); a record claimed
    /// at insert has its first attempt marked with this policy's version.
    pub policy: Policy<'a>,
    /// What its record is made of; whether it is claimed at insert is decided here.
    pub request: Request,
    /// Where its attempts go, when the ingress built it to check the path: an execution that
    /// starts at once sends there; `None`, and the execution builds it from the record.
    pub url: Option<url::Url>,
    /// The request's headers: its `Authorization` is held for the execution when the route
    /// forwards it.
    pub headers: &'a http::HeaderMap,
    /// Whether the request waits for the outcome; a `respond-async` one is answered at once.
    pub awaits: bool,
}

/// A keyed request as the ingress read it: what its record is made of.
pub struct Request {
    pub tenant: Tenant,
    pub key: IdempotencyKey,
    pub method: http::Method,
    pub path: String,
    pub query: String,
    pub fingerprint: Fingerprint,
    pub stored: StoredRequest,
    /// The end of its deadline: the route's, or earlier if the client asked.
    pub deadline_at: Timestamp,
    pub arrival: Arrival,
}

impl Request {
    /// The record to insert for it on `route`, unclaimed, and the retention cut-off its key's
    /// done records are judged by.
    fn record(self, route: &Route) -> (NewRecord, Timestamp) {
        let Request { tenant, key, method, path, query, fingerprint, stored, deadline_at, arrival } = self;
        let arrival = arrival.at;
        let new = NewRecord {
            // Time-ordered: ids of new records land at the end of the id index, not all over it.
            id: RecordId::new(),
            tenant,
            key,
            route: route.name.clone(),
            method,
            path,
            query,
            fingerprint,
            request: stored,
            deadline_at,
            now: arrival,
            policy_version: None,
            claim: None,
            tombstone_cutoff: route.lifetime().tombstone_cutoff(arrival),
        };
        (new, route.lifetime().cutoff(arrival))
    }
}

/// What became of an [`Submission`]. Its variants differ in size, and it stays unboxed: there is one
/// per request, moved once, and boxing the record would cost every duplicate an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Admitted {
    /// This request owns the record, which executes now (or once a worker is free). A request
    /// that waits for its end has it in `outcome`, with its stages when it went out at once:
    /// awaiting it runs the execution, which goes on without the request if it stops waiting.
    /// One that does not wait has `None`, its execution on a task of its own.
    Executing { record: Arc<Record>, outcome: Option<Awaited> },
    /// The key already has a record this request does not own: it decides the answer.
    Existing(Record),
    /// Shed before anything was recorded, and the key has no live record to answer instead.
    Refused(Refusal),
}

/// A worker and a place among a route's attempts, set aside for an execution that starts at once.
pub(super) struct Reservation {
    pub(super) worker: OwnedSemaphorePermit,
    pub(super) attempt: OwnedSemaphorePermit,
    /// Where its first attempt goes, as the ingress built it.
    pub(super) url: Option<url::Url>,
}

// One per execution, moved once into it: boxing the larger variant would cost every new
// key an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Start {
    /// Queued: claim it first.
    Claim,
    /// Already claimed by this process (queued records nobody claimed), with the worker that
    /// was set aside for it before it was claimed.
    Claimed {
        worker: OwnedSemaphorePermit,
        /// When the write that claimed it was sent: its lease is trusted from then.
        granted: crate::domain::clock::Moment,
    },
    /// Admitted claimed, first attempt marked, capacity in hand.
    Reserved {
        reservation: Reservation,
        /// When the insert that claimed it and marked its first attempt was sent: its lease is
        /// trusted, and that attempt's send window runs, from then.
        marked: crate::domain::clock::Moment,
        /// The stages of the new key so far, up to its durable record, when its client waits
        /// for the outcome.
        laps: Option<Laps>,
    },
}

impl Worker {
    /// Admits a new request: sheds it, or records it and starts its execution. Per request this
    /// is one store write (the insert, claimed or not); the execution runs on the request's own
    /// task while its client waits for the outcome, else on one spawned for it.
    pub async fn admit(&self, admit: Submission<'_>) -> Result<Admitted, StoreError> {
        let Submission { route, policy, request, url, headers, awaits } = admit;
        // Timed only when the client waits for the outcome: its answer ends the way.
        let mut laps = awaits.then(|| Laps::starting(request.arrival.monotonic));
        let (new, retention_cutoff) = request.record(route);
        let inner = &self.inner;
        let entered = match inner.switches.isolation(&route.name) {
            Some(wait) => Err(Refusal::Isolated(wait)),
            None => route.enter(),
        };
        let slot = match entered {
            Ok(slot) => slot,
            Err(refusal) => return self.shed(route.config(), refusal, new).await,
        };
        let reservation = reserve(&inner.permits, route.guard(), url);
        // The insert claims the record and marks its first attempt: its lease, and that attempt's
        // send window, are counted from these two readings of one instant, taken just before it.
        let (marked_at, marked) = (inner.clock.now(), crate::domain::clock::Moment::now());
        let new = NewRecord {
            claim: reservation.as_ref().map(|_| inner.claim(marked_at, &policy)),
            policy_version: Some(policy.version.clone()),
            ..new
        };
        // Queued rather than claimed: this process claims it itself, and the insert's notice,
        // which may come back before the insert does, must not be offered to its workers too.
        let id = new.id;
        if reservation.is_none() {
            lock(&inner.mine).insert(id);
        }
        let queued = Instant::now();
        let (tenant, key) = (new.tenant.clone(), new.key.clone());
        let admitted = match inner.store.admit(store::Admit { new, retention_cutoff }).await {
            // Its answer was lost: the insert may or may not be committed. Read back, the key's
            // record says which; never taken as "not written".
            Err(e) => super::in_doubt::admission(&*inner.store, inner.lease, &tenant, &key, id, e).await,
            admitted => admitted,
        };
        if !matches!(&admitted, Ok(Admission::Created(_))) {
            lock(&inner.mine).remove(&id);
        }
        let record = match admitted? {
            Admission::Created(record) | Admission::Requeued(record) => record,
            Admission::Existing(record) => return Ok(Admitted::Existing(record)),
        };
        if route.forward_authorization {
            let credential = headers.get(http::header::AUTHORIZATION).cloned();
            inner.credentials.hold(record.id, credential, record.deadline_at, inner.clock.now());
        }
        // Admitted claimed only when the insert was fresh; a requeued record waits its turn.
        let start = match reservation.filter(|_| record.state == State::InProgress) {
            Some(reservation) => {
                if let Some(laps) = &mut laps {
                    laps.lap_at(Stage::Read, queued);
                    laps.lap(Stage::AdmissionCommit);
                }
                Start::Reserved { reservation, marked, laps }
            }
            None => {
                lock(&inner.mine).insert(record.id);
                Start::Claim
            }
        };
        let record = Arc::new(record);
        let route = Some((route.clone(), slot));
        // A client that waits runs the execution on its own task: spawning it would cost a wake
        // of another thread, and its outcome another back (see `awaited`).
        let outcome = if awaits {
            Some(self.awaited(record.clone(), route, start))
        } else {
            self.spawn(record.clone(), route, start);
            None
        };
        Ok(Admitted::Executing { record, outcome })
    }
}

impl Worker {
    /// A request shed before anything is recorded: its key's live record answers it when it has
    /// one (a duplicate of a done request is replayed whatever the route's load), else the
    /// refusal does. A done record past its route's retention is read as gone, as the record
    /// reader reads it.
    /// `config`: the one the request is served under.
    async fn shed(&self, config: &Config, refusal: Refusal, new: NewRecord) -> Result<Admitted, StoreError> {
        let existing = self.inner.store.lookup(&new.tenant, &new.key).await?;
        let expired = |r: &Record| r.past_retention(config.lifetime_of(&r.route), self.inner.clock.now());
        Ok(match existing.filter(|r| r.phase() != Phase::Free && !expired(r)) {
            Some(record) => Admitted::Existing(record),
            None => Admitted::Refused(refusal),
        })
    }
}

/// Sets aside one of the worker's `permits` and a place among the attempts of `guard`'s route,
/// if both are free right now.
fn reserve(permits: &Arc<Semaphore>, guard: &RouteGuard, url: Option<url::Url>) -> Option<Reservation> {
    let worker = permits.clone().try_acquire_owned().ok()?;
    let attempt = guard.attempts.clone().try_acquire_owned().ok()?;
    Some(Reservation { worker, attempt, url })
}

impl Inner {
    /// The claim that a reserved admission writes at `marked_at`: this process's lease, and how
    /// far its first attempt, sent under `policy`, may reach.
    pub(super) fn claim(&self, marked_at: Timestamp, policy: &Policy<'_>) -> Claim {
        let (owner, lease, reach) = (self.owner.clone(), self.lease, self.reach(policy.retry.per_try_timeout));
        Claim { owner, marked_at, lease, reach }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::time::Duration;

    use super::super::Slot;
    use super::*;
    use crate::config::Config;
    use crate::domain::clock::ManualClock;
    use crate::runtime::{Live, ServedRoute};

    pub(in crate::worker) const NOW: Timestamp = Timestamp::from_millis(1_700_000_000_000);

    fn config(route_extra: &str) -> Config {
        config_at("sqlite::memory:", route_extra)
    }

    /// `payments` of `config`, served on the system's clock.
    fn served(config: Config) -> ServedRoute {
        Live::new(config, crate::domain::clock::system()).served().route_named("payments").unwrap()
    }

    /// Two workers, a lease of ten seconds, and one route, `payments`, with `route_extra`.
    fn config_at(store_url: &str, route_extra: &str) -> Config {
        let text = format!(
            "[store]\nurl = \"{store_url}\"\n[worker]\nconcurrency = 2\nlease = \"10s\"\n\n[[routes]]\n\
             name = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"http://127.0.0.1:9\"\n{route_extra}\n"
        );
        Config::parse_with_env(&text, |_| None).unwrap()
    }

    /// A worker on a fresh SQLite store in `dir`, whose clock stands at `NOW` until moved.
    async fn worker_on_clock(dir: &tempfile::TempDir, route_extra: &str) -> Worker {
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let config = config_at(&url, route_extra);
        let clock = Arc::new(ManualClock::new(NOW));
        Worker::on(crate::store::open(&url).await.unwrap(), config, "here", clock)
    }

    /// A request for `payments` under `key`, arriving at `NOW`, as the ingress reads it.
    fn keyed(key: &str) -> Request {
        Request {
            tenant: "default".into(),
            key: crate::domain::key::IdempotencyKey::parse(key).unwrap(),
            method: http::Method::POST,
            path: "/payments".into(),
            query: String::new(),
            fingerprint: crate::domain::fingerprint::Fingerprint::of("payments", "POST", "/payments", "", None, b"{}"),
            stored: crate::record::StoredRequest { headers: vec![], body: bytes::Bytes::new() },
            deadline_at: NOW + Duration::from_millis(30_000),
            arrival: Arrival { at: NOW, monotonic: Instant::now() },
        }
    }

    /// Its record, as the worker makes it.
    pub(in crate::worker) fn request(key: &str) -> NewRecord {
        keyed(key).record(&config_at("sqlite://unused", "").routes[0]).0
    }

    async fn admit(worker: &Worker, key: &str, awaits: bool) -> Admitted {
        let route = worker.inner.config.served().route_named("payments").unwrap();
        let admit = Submission {
            route: &route,
            policy: route.policy_for(&"default".into(), &crate::domain::key::IdempotencyKey::parse(key).unwrap(), true),
            request: keyed(key),
            url: None,
            headers: &http::HeaderMap::new(),
            awaits,
        };
        worker.admit(admit).await.unwrap()
    }

    #[tokio::test]
    async fn with_a_worker_free_a_new_request_is_recorded_claimed_its_first_attempt_marked_now() {
        let dir = tempfile::TempDir::new().unwrap();
        let worker = worker_on_clock(&dir, "").await;
        let Admitted::Executing { record, outcome } = admit(&worker, "fresh", false).await else {
            panic!("a new key on a free route executes")
        };
        assert!(outcome.is_none(), "nobody waits for it: answered at once");
        assert_eq!(record.state, State::InProgress);
        let lease = record.lease.as_ref().expect("claimed in the same commit");
        assert_eq!((lease.owner.as_str(), lease.expires_at), ("here", NOW + Duration::from_millis(10_000)));
        assert_eq!(record.in_flight, Some((1, NOW)), "its first attempt marked as sent now");
        // The same key again is not this request's to execute.
        assert!(matches!(admit(&worker, "fresh", true).await, Admitted::Existing(_)));
    }

    #[tokio::test]
    async fn an_isolated_route_sheds_before_recording_unless_the_key_has_a_record_to_answer() {
        let dir = tempfile::TempDir::new().unwrap();
        let worker = worker_on_clock(&dir, "").await;
        // A key recorded before the switch, held queued (the test holds every worker, so it
        // cannot run and free its key): its record answers its duplicates.
        let _busy = worker.free_workers(usize::MAX);
        assert!(matches!(admit(&worker, "earlier", false).await, Admitted::Executing { .. }));
        let isolate = crate::domain::switch::SetRequest {
            scope: Some("payments".into()),
            action: Some("isolate".into()),
            reason: Some("upstream down".into()),
            ..Default::default()
        };
        let switch = isolate.parse(uuid::Uuid::now_v7(), NOW, |_| true).unwrap();
        let inner = &worker.inner;
        inner.store.set_switch(switch).await.unwrap();
        inner.switches.refresh(&*inner.store).await.unwrap();
        match admit(&worker, "held", true).await {
            Admitted::Refused(Refusal::Isolated(wait)) => assert!(wait >= Duration::from_secs(1), "{wait:?}"),
            _ => panic!("an isolated route takes no new key"),
        }
        assert!(
            inner
                .store
                .lookup(&"default".into(), &crate::domain::key::IdempotencyKey::parse("held").unwrap())
                .await
                .unwrap()
                .is_none(),
            "nothing recorded"
        );
        match admit(&worker, "earlier", true).await {
            Admitted::Existing(record) => assert_eq!(record.key, "earlier"),
            _ => panic!("a key with a live record is answered by it, isolated or not"),
        }
    }

    #[test]
    fn a_route_takes_its_concurrency_and_a_bounded_queue_then_sheds() {
        let route = served(config("max_concurrency = 4"));
        // Four in flight and, at that size, four queued behind them (the queue is at least 4).
        let slots: Vec<Slot> = (0..8).map(|_| route.enter().expect("within the bound")).collect();
        assert_eq!(route.enter().err(), Some(Refusal::Overloaded));
        // A refused entry holds no place: one leaving makes room for exactly one more.
        drop(slots.into_iter().next());
        assert!(route.enter().is_ok());
    }

    #[test]
    fn places_taken_outside_the_ingress_count_but_are_never_refused() {
        let route = served(config("max_concurrency = 1"));
        let taken: Vec<_> = (0..5).map(|_| route.enter().unwrap()).collect();
        let _take_over = route.slot();
        assert_eq!(route.guard().pending.load(std::sync::atomic::Ordering::SeqCst), 6, "a take-over is never refused");
        assert_eq!(route.enter().err(), Some(Refusal::Overloaded));
        drop(taken);
        let live = Live::new(config("max_concurrency = 1"), crate::domain::clock::system());
        assert!(live.served().route_named("gone").is_none(), "a route no longer configured has no guard to count on");
    }

    #[test]
    fn an_open_circuit_sheds_with_the_time_until_it_half_opens() {
        let route = served(config("[routes.circuit]\nfailures = 2\nopen_for = \"30s\""));
        for _ in 0..2 {
            route.record_outcome(false);
        }
        match route.enter() {
            Err(Refusal::CircuitOpen(wait)) => assert!(wait <= Duration::from_secs(30) && !wait.is_zero(), "{wait:?}"),
            other => panic!("expected an open circuit, got {:?}", other.map(|_| "a slot")),
        }
    }

    #[test]
    fn a_reservation_needs_both_a_free_worker_and_a_free_place_on_the_route() {
        let route = served(config("max_concurrency = 1"));
        let permits = Arc::new(Semaphore::new(2));
        let reserve = || reserve(&permits, route.guard(), None);
        let first = reserve().expect("a worker and a place are free");
        assert!(reserve().is_none(), "the route's one place is taken");
        drop(first);
        let busy: Vec<_> = (0..2).map(|_| permits.clone().try_acquire_owned().unwrap()).collect();
        assert!(reserve().is_none(), "no worker is free");
        drop(busy);
        assert!(reserve().is_some());
    }
}
