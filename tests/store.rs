//! The `Store` contract, case by case, on both backends: every case below runs once on SQLite
//! (`sqlite::<case>`) and once on PostgreSQL (`postgres::<case>`), each on an empty database.
//! Times are fixed numbers, not the clock: the store takes every time it uses as an argument.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::backend::{fresh_store, skipped, Backend};
use idem::fingerprint::Fingerprint;
use idem::policy::StopReason;
use idem::record::{header_text, Attempt, HistoryEntry, Millis, Phase, Record, State, StoredRequest, StoredResponse};
use idem::store::{
    self, Action, Admission, AfterAttempt, Cancelled, Claim, Cursor, Lease, ListFilter, NewRecord, Notice, Resolution,
    Store,
};
use tokio::sync::broadcast;
use uuid::Uuid;

/// Runs `case` on an empty database of `backend`, then removes that database.
async fn run<F, Fut>(backend: Backend, test: &str, case: F)
where
    F: FnOnce(Arc<dyn Store>, String) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some((store, db)) = fresh_store(backend).await else {
        return skipped(test);
    };
    case(store, db.url.clone()).await;
    db.drop_database().await;
}

/// For each case, `sqlite::<case>` and `postgres::<case>`; the cases after `postgres_only:`
/// exercise what only PostgreSQL offers.
macro_rules! on_both_backends {
    ($($case:ident),* $(,)? ; postgres_only: $($pg_case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::run(super::Backend::Sqlite, concat!("sqlite::", stringify!($case)), |store, _| {
                        super::$case(store)
                    })
                    .await
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::run(super::Backend::Postgres, concat!("postgres::", stringify!($case)), |store, _| {
                        super::$case(store)
                    })
                    .await
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $pg_case() {
                    super::run(super::Backend::Postgres, concat!("postgres::", stringify!($pg_case)), super::$pg_case)
                        .await
                }
            )*
        }
    };
}

on_both_backends!(
    admit_creates_a_record_then_returns_it_for_the_same_key,
    of_64_concurrent_admits_of_one_key_exactly_one_creates_the_record,
    concurrent_admits_of_many_keys_create_each_once_and_answer_what_they_stored,
    two_tenants_with_one_key_have_independent_records,
    a_free_record_is_requeued_by_the_same_request_and_kept_from_another,
    a_done_record_past_retention_is_replaced_with_a_new_id,
    a_queued_record_is_claimed_once,
    a_worker_that_does_not_hold_the_lease_is_told_it_lost_it,
    a_done_attempt_stores_the_response_byte_for_byte_and_the_attempts,
    cancelling_a_queued_record_frees_it,
    cancelling_an_in_progress_record_asks_its_worker_to_stop,
    resolve_and_retry_apply_only_to_unknown_records_and_keep_history,
    take_over_is_a_compare_and_set_on_the_expired_lease,
    two_concurrent_callers_claim_each_unclaimed_record_once,
    probes_are_due_after_settle_and_then_at_the_next_probe_time,
    listing_filters_and_pages_through_every_record_exactly_once,
    records_are_counted_by_phase,
    sweeping_deletes_only_done_records_finished_before_the_cutoff,
    an_admission_with_a_claim_is_recorded_in_progress_with_its_first_attempt_marked,
    ;
    postgres_only:
    notices_announce_queued_and_settled_records_to_every_process,
);

async fn an_admission_with_a_claim_is_recorded_in_progress_with_its_first_attempt_marked(store: Arc<dyn Store>) {
    let claim = Claim { owner: WORKER.into(), lease_until: T0 + LEASE };
    let new = NewRecord { claim: Some(claim.clone()), ..request("default", "express", BODY) };
    let record = created(store.admit(new.clone(), 0).await.unwrap());
    assert_eq!(record.phase(), Phase::InProgress);
    assert_eq!(record.lease, Some(idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE }));
    assert_eq!(record.in_flight, Some((1, T0)), "attempt 1 is marked as about to be sent");
    assert_same(&record, &fetch(&store, record.id).await);
    // The claim holds like any other: its worker may store the outcome, nobody else may.
    assert!(store.renew(record.id, WORKER, T0 + LEASE + 1, T0 + 2).await.unwrap().is_held());
    assert_eq!(store.renew(record.id, "someone-else", T0 + LEASE, T0 + 2).await.unwrap(), Lease::Lost);
    // A duplicate sees it in progress; it is not admitted twice.
    assert!(matches!(store.admit(new, 0).await.unwrap(), Admission::Existing(r) if r.id == record.id));

    // A free record taken up again is queued, whatever the claim says: its worker claims it.
    let freed = request("default", "freed", BODY);
    let first = in_progress(&store, freed.clone()).await;
    store.attempt_ended(first.id, WORKER, None, AfterAttempt::Free(StopReason::AttemptCap), T0 + 5).await.unwrap();
    let again = NewRecord { id: Uuid::new_v4(), claim: Some(claim), ..freed };
    match store.admit(again, 0).await.unwrap() {
        Admission::Requeued(r) => {
            assert_eq!(r.phase(), Phase::Queued);
            assert_eq!(r.in_flight, None);
            assert_eq!(r.lease, None);
        }
        other => panic!("expected a requeue, got {other:?}"),
    }
}

// ---- fixtures -----------------------------------------------------------------------------------

/// An arbitrary fixed instant; tests move time by adding to it.
const T0: Millis = 1_700_000_000_000;
const BODY: &[u8] = br#"{"amount":42,"currency":"eur"}"#;
const WORKER: &str = "node-a/worker-1";
const LEASE: Millis = 15_000;

fn request(tenant: &str, key: &str, body: &[u8]) -> NewRecord {
    request_on("payments", tenant, key, body, T0)
}

fn request_on(route: &str, tenant: &str, key: &str, body: &[u8], now: Millis) -> NewRecord {
    let path = format!("/{route}");
    NewRecord {
        id: Uuid::new_v4(),
        tenant: tenant.into(),
        key: key.into(),
        route: route.into(),
        method: "POST".into(),
        path: path.clone(),
        query: "currency=eur".into(),
        fingerprint: Fingerprint::of(route, "POST", &path, "currency=eur", Some(b"application/json"), body),
        request: StoredRequest {
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::copy_from_slice(body),
        },
        deadline_at: now + 30_000,
        now,
        claim: None,
    }
}

fn entry(actor: &str, action: &str, at: Millis) -> HistoryEntry {
    HistoryEntry { at, actor: actor.into(), action: action.into(), note: Some(format!("{actor} {action}")) }
}

fn attempt(number: u32, started_at: Millis, outcome: &str, status: Option<u16>) -> Attempt {
    Attempt {
        number,
        started_at,
        duration_ms: 12,
        outcome: outcome.into(),
        status,
        error: status.is_none().then(|| "timed_out".to_string()),
        wait_ms: if number == 1 { 0 } else { 250 },
    }
}

fn response(status: u16, body: &[u8]) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("set-cookie".into(), "a=1".into()),
            ("set-cookie".into(), "b=2".into()),
            ("x-latin-1".into(), header_text(&[b'c', 0xe9, 0xff, b'"', b'\\'])),
        ],
        body: Bytes::copy_from_slice(body),
    }
}

/// A fresh admission is answered without reading the row back: what it answers must be what
/// was stored, field for field.
fn assert_same(answered: &Record, stored: &Record) {
    assert_eq!(format!("{answered:#?}"), format!("{stored:#?}"), "the admission's answer differs from the row");
}

fn created(admission: Admission) -> Record {
    match admission {
        Admission::Created(record) => record,
        other => panic!("expected Created, got {other:?}"),
    }
}

fn existing(admission: Admission) -> Record {
    match admission {
        Admission::Existing(record) => record,
        other => panic!("expected Existing, got {other:?}"),
    }
}

fn applied(action: Action) -> Record {
    match action {
        Action::Applied(record) => record,
        other => panic!("expected Applied, got {other:?}"),
    }
}

fn refused(action: Action) -> Record {
    match action {
        Action::Refused(record) => record,
        other => panic!("expected Refused, got {other:?}"),
    }
}

async fn fetch(store: &Arc<dyn Store>, id: Uuid) -> Record {
    store.get(id).await.unwrap().unwrap_or_else(|| panic!("record {id} is missing"))
}

async fn queued(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    created(store.admit(new, 0).await.unwrap())
}

/// A record claimed by [`WORKER`] with a lease until `T0 + LEASE`.
async fn in_progress(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    let record = queued(store, new).await;
    assert!(store.claim(record.id, WORKER, T0 + LEASE, T0 + 1).await.unwrap());
    fetch(store, record.id).await
}

/// A record whose first attempt ended ambiguously at `T0 + 100` on a route that is not
/// replay-safe.
async fn unknown(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    let record = in_progress(store, new).await;
    let lease = store.attempt_started(record.id, WORKER, 1, T0 + 10, T0 + LEASE).await.unwrap();
    assert!(lease.is_held());
    let lease = store
        .attempt_ended(
            record.id,
            WORKER,
            Some(attempt(1, T0 + 10, "ambiguous", None)),
            AfterAttempt::Unknown(StopReason::UnsafeReplay),
            T0 + 100,
        )
        .await
        .unwrap();
    assert!(lease.is_held());
    let record = fetch(store, record.id).await;
    assert_eq!(record.phase(), Phase::Unknown);
    record
}

/// A record answered `201` at `done_at`.
async fn done(store: &Arc<dyn Store>, new: NewRecord, done_at: Millis) -> Record {
    let record = in_progress(store, new).await;
    assert!(store.attempt_started(record.id, WORKER, 1, T0 + 10, T0 + LEASE).await.unwrap().is_held());
    let lease = store
        .attempt_ended(
            record.id,
            WORKER,
            Some(attempt(1, T0 + 10, "success", Some(201))),
            AfterAttempt::Done(StopReason::Success, response(201, b"{\"ok\":true}")),
            done_at,
        )
        .await
        .unwrap();
    assert!(lease.is_held());
    let record = fetch(store, record.id).await;
    assert_eq!(record.phase(), Phase::Done);
    record
}

/// A record whose attempts stopped with nothing executed: `not_started`, free.
async fn free(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    let record = in_progress(store, new).await;
    let lease =
        store.attempt_ended(record.id, WORKER, None, AfterAttempt::Free(StopReason::Deadline), T0 + 100).await.unwrap();
    assert!(lease.is_held());
    let record = fetch(store, record.id).await;
    assert_eq!(record.phase(), Phase::Free);
    record
}

// ---- admission ----------------------------------------------------------------------------------

async fn admit_creates_a_record_then_returns_it_for_the_same_key(store: Arc<dyn Store>) {
    let new = request("default", "order-1", BODY);
    let record = created(store.admit(new.clone(), 0).await.unwrap());
    assert_eq!(record.id, new.id);
    assert_eq!((record.tenant.as_str(), record.key.as_str()), ("default", "order-1"));
    assert_eq!(
        (record.route.as_str(), record.method.as_str(), record.path.as_str(), record.query.as_str()),
        ("payments", "POST", "/payments", "currency=eur")
    );
    assert_eq!(record.fingerprint, new.fingerprint);
    assert_eq!(record.request, new.request);
    assert_eq!(record.phase(), Phase::Queued);
    assert_eq!((record.deadline_at, record.created_at, record.updated_at), (T0 + 30_000, T0, T0));
    assert!(record.lease.is_none() && record.in_flight.is_none() && record.response.is_none());
    assert!(record.attempts.is_empty() && record.history.is_empty() && !record.cancel_requested);
    assert_same(&record, &fetch(&store, new.id).await);

    let again = existing(store.admit(request("default", "order-1", BODY), 0).await.unwrap());
    assert_eq!(again.id, new.id);
    assert_eq!(again.phase(), Phase::Queued);

    assert_eq!(store.lookup("default", "order-1").await.unwrap().map(|r| r.id), Some(new.id));
    assert_eq!(fetch(&store, new.id).await.key, "order-1");
    assert!(store.lookup("default", "order-2").await.unwrap().is_none());
    assert!(store.get(Uuid::new_v4()).await.unwrap().is_none());
    store.ping().await.unwrap();
}

async fn of_64_concurrent_admits_of_one_key_exactly_one_creates_the_record(store: Arc<dyn Store>) {
    let admits: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.admit(request("default", "contended", BODY), 0).await.unwrap() })
        })
        .collect();
    let mut created_ids = Vec::new();
    let mut existing_ids = HashSet::new();
    for admit in admits {
        match admit.await.unwrap() {
            Admission::Created(record) => created_ids.push(record.id),
            Admission::Existing(record) => {
                existing_ids.insert(record.id);
            }
            Admission::Requeued(record) => panic!("nothing was free to requeue: {record:?}"),
        }
    }
    assert_eq!(created_ids.len(), 1, "exactly one admit creates the record");
    assert_eq!(existing_ids, HashSet::from([created_ids[0]]), "the others all see that record");
    let listed = store.list(&ListFilter { limit: 100, ..ListFilter::default() }).await.unwrap();
    assert_eq!(listed.items.len(), 1);
}

/// Admissions arriving together (which a store may write together): fresh keys, each sent at
/// least twice, once claimed and once queued, beside a key whose expired record is taken over. Each key
/// gets one record, made by one of its admissions, and that admission's answer is the row.
async fn concurrent_admits_of_many_keys_create_each_once_and_answer_what_they_stored(store: Arc<dyn Store>) {
    let old = done(&store, request("default", "expired", BODY), T0).await;
    let admits: Vec<_> = (0..128)
        .map(|i| {
            let store = store.clone();
            let key = if i == 127 { "expired".to_string() } else { format!("fresh-{}", i % 63) };
            let claim = (i % 2 == 0).then(|| Claim { owner: WORKER.into(), lease_until: T0 + LEASE });
            let new = NewRecord { claim, ..request("default", &key, BODY) };
            tokio::spawn(async move { (key, store.admit(new, T0 + 1).await.unwrap()) })
        })
        .collect();
    let mut made: HashMap<String, Vec<Record>> = HashMap::new();
    let mut seen: HashMap<String, HashSet<Uuid>> = HashMap::new();
    for admit in admits {
        let (key, admission) = admit.await.unwrap();
        let record = match admission {
            Admission::Created(record) | Admission::Requeued(record) => {
                made.entry(key.clone()).or_default().push(record.clone());
                record
            }
            Admission::Existing(record) => record,
        };
        seen.entry(key).or_default().insert(record.id);
    }
    assert_eq!(made.len(), 64, "every key was admitted once: {:?}", made.keys());
    for (key, records) in &made {
        assert_eq!(records.len(), 1, "`{key}` was admitted {} times", records.len());
        let stored = store.lookup("default", key).await.unwrap().unwrap();
        assert_eq!(seen[key], HashSet::from([stored.id]), "`{key}`: every admission saw the one record");
        if key != "expired" {
            assert_same(&records[0], &stored);
        }
    }
    let taken = store.lookup("default", "expired").await.unwrap().unwrap();
    assert_ne!(taken.id, old.id, "the expired record was replaced");
    assert_eq!(taken.state, State::NotStarted, "a record taken over is queued, not claimed");
}

async fn two_tenants_with_one_key_have_independent_records(store: Arc<dyn Store>) {
    let acme = queued(&store, request("acme", "shared-key", BODY)).await;
    let globex = created(store.admit(request("globex", "shared-key", b"{\"other\":1}"), 0).await.unwrap());
    assert_ne!(acme.id, globex.id);
    assert_eq!(store.lookup("acme", "shared-key").await.unwrap().unwrap().id, acme.id);
    assert_eq!(store.lookup("globex", "shared-key").await.unwrap().unwrap().id, globex.id);
    assert!(store.lookup("initech", "shared-key").await.unwrap().is_none());

    // Settling one tenant's record leaves the other's alone.
    assert!(store.claim(acme.id, WORKER, T0 + LEASE, T0 + 1).await.unwrap());
    assert_eq!(fetch(&store, globex.id).await.phase(), Phase::Queued);
}

async fn a_free_record_is_requeued_by_the_same_request_and_kept_from_another(store: Arc<dyn Store>) {
    let first = free(&store, request("default", "retry-me", BODY)).await;
    assert_eq!(first.stop_reason, Some(StopReason::Deadline));

    let other = existing(store.admit(request("default", "retry-me", b"{\"amount\":43}"), 0).await.unwrap());
    assert_eq!(other.id, first.id);
    assert_eq!(other.phase(), Phase::Free, "another request must not take the key over");

    let mut again = request("default", "retry-me", BODY);
    again.now = T0 + 5_000;
    again.deadline_at = T0 + 35_000;
    let requeued = match store.admit(again, 0).await.unwrap() {
        Admission::Requeued(record) => record,
        other => panic!("expected Requeued, got {other:?}"),
    };
    assert_eq!(requeued.id, first.id, "a requeued record keeps its id");
    assert_eq!(requeued.phase(), Phase::Queued);
    assert_eq!((requeued.created_at, requeued.updated_at, requeued.deadline_at), (T0, T0 + 5_000, T0 + 35_000));
    assert_eq!(requeued.stop_reason, None);
    let last = requeued.history.last().expect("the requeue is in the history");
    assert_eq!((last.actor.as_str(), last.action.as_str(), last.at), ("client", "requeued", T0 + 5_000));

    // Queued again, it is no longer free: a second identical request is a duplicate.
    assert_eq!(existing(store.admit(request("default", "retry-me", BODY), 0).await.unwrap()).id, first.id);
}

async fn a_done_record_past_retention_is_replaced_with_a_new_id(store: Arc<dyn Store>) {
    let old = done(&store, request("default", "old", BODY), T0 + 1_000).await;

    // Finished exactly at the cutoff: still retained, still replayed.
    let kept = existing(store.admit(request("default", "old", BODY), T0 + 1_000).await.unwrap());
    assert_eq!((kept.id, kept.phase()), (old.id, Phase::Done));

    let mut new = request("default", "old", b"{\"amount\":1}");
    new.now = T0 + 90_000;
    let replaced = created(store.admit(new.clone(), T0 + 1_001).await.unwrap());
    assert_eq!(replaced.id, new.id);
    assert_ne!(replaced.id, old.id);
    assert_eq!(replaced.phase(), Phase::Queued);
    assert_eq!(replaced.fingerprint, new.fingerprint);
    assert_eq!(replaced.created_at, T0 + 90_000);
    assert!(replaced.attempts.is_empty() && replaced.history.is_empty());
    assert!(replaced.response.is_none() && replaced.stop_reason.is_none() && replaced.lease.is_none());
    assert!(store.get(old.id).await.unwrap().is_none());

    // With a claim, the replacement is still queued (its worker claims it), and says so.
    let old = done(&store, request("default", "old-claimed", BODY), T0 + 1_000).await;
    let claim = Claim { owner: WORKER.into(), lease_until: T0 + LEASE };
    let new = NewRecord { claim: Some(claim), ..request("default", "old-claimed", BODY) };
    let replaced = created(store.admit(new.clone(), T0 + 1_001).await.unwrap());
    assert_eq!((replaced.id, replaced.phase(), replaced.in_flight), (new.id, Phase::Queued, None));
    assert_eq!(fetch(&store, new.id).await.phase(), Phase::Queued, "as stored");
    assert_ne!(replaced.id, old.id);
}

// ---- execution ----------------------------------------------------------------------------------

async fn a_queued_record_is_claimed_once(store: Arc<dyn Store>) {
    let record = queued(&store, request("default", "claim", BODY)).await;
    assert!(store.claim(record.id, WORKER, T0 + LEASE, T0 + 1).await.unwrap());
    assert!(!store.claim(record.id, "node-b/worker-1", T0 + LEASE, T0 + 2).await.unwrap());
    assert!(!store.claim(Uuid::new_v4(), WORKER, T0 + LEASE, T0 + 2).await.unwrap());
    let record = fetch(&store, record.id).await;
    assert_eq!(record.phase(), Phase::InProgress);
    let lease = record.lease.expect("a claimed record has a lease");
    assert_eq!((lease.owner.as_str(), lease.expires_at), (WORKER, T0 + LEASE));
    assert_eq!(record.updated_at, T0 + 1);
}

async fn a_worker_that_does_not_hold_the_lease_is_told_it_lost_it(store: Arc<dyn Store>) {
    let record = in_progress(&store, request("default", "lease", BODY)).await;
    let thief = "node-b/worker-9";
    assert_eq!(store.attempt_started(record.id, thief, 1, T0 + 10, T0 + 99_000).await.unwrap(), Lease::Lost);
    assert_eq!(store.renew(record.id, thief, T0 + 99_000, T0 + 10).await.unwrap(), Lease::Lost);
    let ended = store
        .attempt_ended(
            record.id,
            thief,
            Some(attempt(1, T0 + 10, "success", Some(200))),
            AfterAttempt::Done(StopReason::Success, response(200, b"stolen")),
            T0 + 20,
        )
        .await
        .unwrap();
    assert_eq!(ended, Lease::Lost);
    let unchanged = fetch(&store, record.id).await;
    assert_eq!(unchanged.phase(), Phase::InProgress);
    assert_eq!(unchanged.lease, record.lease);
    assert!(unchanged.in_flight.is_none() && unchanged.attempts.is_empty() && unchanged.response.is_none());

    // The holder is told it holds it, and its lease moves.
    let held = store.attempt_started(record.id, WORKER, 1, T0 + 10, T0 + 20_000).await.unwrap();
    assert_eq!(held, Lease::Held { cancel_requested: false });
    let record = fetch(&store, record.id).await;
    assert_eq!(record.in_flight, Some((1, T0 + 10)));
    assert_eq!(record.lease.as_ref().map(|l| l.expires_at), Some(T0 + 20_000));
    assert_eq!(store.renew(record.id, WORKER, T0 + 25_000, T0 + 11).await.unwrap(), held);
    assert_eq!(fetch(&store, record.id).await.lease.map(|l| l.expires_at), Some(T0 + 25_000));

    // Once settled, nobody holds it.
    let lease = store
        .attempt_ended(record.id, WORKER, None, AfterAttempt::Unknown(StopReason::UnsafeReplay), T0 + 30)
        .await
        .unwrap();
    assert!(lease.is_held());
    assert_eq!(store.renew(record.id, WORKER, T0 + 30_000, T0 + 31).await.unwrap(), Lease::Lost);
}

async fn a_done_attempt_stores_the_response_byte_for_byte_and_the_attempts(store: Arc<dyn Store>) {
    let binary_request: Vec<u8> = (0..=255u8).rev().collect();
    let mut new = request("default", "bytes", &binary_request);
    new.request.headers.push(("x-raw".into(), header_text(&[0x80, 0xfe, b' ', b'x'])));
    let record = in_progress(&store, new.clone()).await;
    assert_eq!(record.request, new.request, "the request is kept byte for byte");

    let first = attempt(1, T0 + 10, "not_executed", Some(503));
    assert!(store.attempt_started(record.id, WORKER, 1, T0 + 10, T0 + LEASE).await.unwrap().is_held());
    let wait = AfterAttempt::Wait { not_before: T0 + 250 };
    let lease = store.attempt_ended(record.id, WORKER, Some(first.clone()), wait, T0 + 30).await.unwrap();
    assert!(lease.is_held());
    let waiting = fetch(&store, record.id).await;
    assert_eq!(waiting.phase(), Phase::InProgress, "a wait keeps the record");
    assert_eq!(waiting.not_before, Some(T0 + 250), "and when the next attempt may start");
    assert_eq!(waiting.lease.as_ref().map(|l| l.owner.as_str()), Some(WORKER), "and the lease");
    assert_eq!(waiting.in_flight, None, "the attempt's outcome is recorded");
    assert_eq!(waiting.attempts, vec![first.clone()]);

    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend_from_slice(&[0xc3, 0x28, 0x00, 0xff, 0xfe]);
    let answer = response(201, &body);
    let second = attempt(2, T0 + 300, "success", Some(201));
    assert!(store.attempt_started(record.id, WORKER, 2, T0 + 300, T0 + LEASE).await.unwrap().is_held());
    assert_eq!(fetch(&store, record.id).await.in_flight, Some((2, T0 + 300)));
    let lease = store
        .attempt_ended(
            record.id,
            WORKER,
            Some(second.clone()),
            AfterAttempt::Done(StopReason::Success, answer.clone()),
            T0 + 320,
        )
        .await
        .unwrap();
    assert_eq!(lease, Lease::Held { cancel_requested: false });

    let done = fetch(&store, record.id).await;
    assert_eq!(done.phase(), Phase::Done);
    assert_eq!(done.response, Some(answer), "status, headers and body exactly as received");
    assert_eq!(done.attempts, vec![first, second]);
    assert_eq!(done.stop_reason, Some(StopReason::Success));
    assert_eq!((done.lease, done.in_flight, done.updated_at), (None, None, T0 + 320));
    assert_eq!(store.lookup("default", "bytes").await.unwrap().unwrap().response, done.response);
}

async fn cancelling_a_queued_record_frees_it(store: Arc<dyn Store>) {
    let record = queued(&store, request("default", "cancel-queued", BODY)).await;
    let note = entry("client", "cancel", T0 + 50);
    let freed = match store.cancel(record.id, note.clone()).await.unwrap() {
        Cancelled::Dequeued(record) => record,
        other => panic!("expected Dequeued, got {other:?}"),
    };
    assert_eq!(freed.phase(), Phase::Free);
    assert_eq!(freed.stop_reason, Some(StopReason::Cancelled));
    assert_eq!(freed.history, vec![note.clone()]);
    assert!(!store.claim(record.id, WORKER, T0 + LEASE, T0 + 60).await.unwrap(), "nothing is left to run");

    // Free, it has nothing left to cancel; neither has a done record or a missing one.
    assert!(matches!(store.cancel(record.id, note.clone()).await.unwrap(), Cancelled::Refused(r) if r.id == record.id));
    let finished = done(&store, request("default", "cancel-done", BODY), T0 + 100).await;
    match store.cancel(finished.id, note.clone()).await.unwrap() {
        Cancelled::Refused(r) => assert_eq!((r.phase(), r.history.len()), (Phase::Done, 0)),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(matches!(store.cancel(Uuid::new_v4(), note).await.unwrap(), Cancelled::Missing));
}

async fn cancelling_an_in_progress_record_asks_its_worker_to_stop(store: Arc<dyn Store>) {
    let record = in_progress(&store, request("default", "cancel-running", BODY)).await;
    assert_eq!(
        store.renew(record.id, WORKER, T0 + LEASE, T0 + 5).await.unwrap(),
        Lease::Held { cancel_requested: false }
    );
    let note = entry("operator", "cancel", T0 + 50);
    let flagged = match store.cancel(record.id, note.clone()).await.unwrap() {
        Cancelled::Flagged(record) => record,
        other => panic!("expected Flagged, got {other:?}"),
    };
    assert_eq!(flagged.phase(), Phase::InProgress, "an attempt in flight finishes");
    assert!(flagged.cancel_requested);
    assert_eq!(flagged.history, vec![note]);
    assert_eq!(
        store.renew(record.id, WORKER, T0 + LEASE, T0 + 60).await.unwrap(),
        Lease::Held { cancel_requested: true }
    );
    assert!(store.attempt_started(record.id, WORKER, 2, T0 + 70, T0 + LEASE).await.unwrap().cancel_requested());
}

// ---- operators ----------------------------------------------------------------------------------

async fn resolve_and_retry_apply_only_to_unknown_records_and_keep_history(store: Arc<dyn Store>) {
    let waiting = queued(&store, request("default", "queued", BODY)).await;
    let note = entry("alice", "resolve", T0 + 1_000);
    let untouched = refused(store.resolve(waiting.id, Resolution::NotExecuted, note.clone()).await.unwrap());
    assert_eq!((untouched.phase(), untouched.history.len()), (Phase::Queued, 0));
    let untouched = refused(store.retry(waiting.id, T0 + 99_000, note.clone()).await.unwrap());
    assert_eq!((untouched.phase(), untouched.deadline_at), (Phase::Queued, T0 + 30_000));
    assert!(matches!(
        store.resolve(Uuid::new_v4(), Resolution::NotExecuted, note.clone()).await.unwrap(),
        Action::Missing
    ));
    assert!(matches!(store.retry(Uuid::new_v4(), T0, note.clone()).await.unwrap(), Action::Missing));

    // Executed: done, with the operator's response replayed from now on.
    let executed = unknown(&store, request("default", "executed", BODY)).await;
    let answer = response(200, b"{\"confirmed\":true}");
    let resolved =
        applied(store.resolve(executed.id, Resolution::Executed(answer.clone()), note.clone()).await.unwrap());
    assert_eq!(resolved.phase(), Phase::Done);
    assert_eq!(resolved.response, Some(answer));
    assert_eq!(resolved.history, vec![note.clone()]);
    assert_eq!((resolved.updated_at, resolved.probe_count), (T0 + 1_000, 0));
    assert_eq!(resolved.attempts.len(), 1, "the attempts are kept");
    refused(store.resolve(executed.id, Resolution::NotExecuted, note.clone()).await.unwrap());
    refused(store.retry(executed.id, T0 + 99_000, note.clone()).await.unwrap());

    // Not executed: the key is free.
    let not_executed = unknown(&store, request("default", "not-executed", BODY)).await;
    let freed = applied(store.resolve(not_executed.id, Resolution::NotExecuted, note.clone()).await.unwrap());
    assert_eq!((freed.phase(), freed.response.is_none()), (Phase::Free, true));
    assert_eq!(freed.history, vec![note.clone()]);

    // Retried: queued again with a fresh deadline, for a worker to claim.
    let retried = unknown(&store, request("default", "retried", BODY)).await;
    let again = entry("bob", "retry", T0 + 2_000);
    let requeued = applied(store.retry(retried.id, T0 + 99_000, again.clone()).await.unwrap());
    assert_eq!(requeued.phase(), Phase::Queued);
    assert_eq!((requeued.deadline_at, requeued.stop_reason, requeued.updated_at), (T0 + 99_000, None, T0 + 2_000));
    assert_eq!(requeued.history, vec![again]);
    assert!(store.claim(retried.id, WORKER, T0 + 2_000 + LEASE, T0 + 2_001).await.unwrap());
}

// ---- take-over and reconciliation ---------------------------------------------------------------

async fn take_over_is_a_compare_and_set_on_the_expired_lease(store: Arc<dyn Store>) {
    let record = in_progress(&store, request("default", "orphan", BODY)).await;
    let until = T0 + 20_000;
    assert!(store.attempt_started(record.id, WORKER, 1, T0 + 10, until).await.unwrap().is_held());
    assert!(store.expired_leases(until, 10).await.unwrap().is_empty(), "not expired while `until` is now");
    let expired = store.expired_leases(until + 1, 10).await.unwrap();
    assert_eq!(expired.iter().map(|r| r.id).collect::<Vec<_>>(), vec![record.id]);

    let lost = attempt(1, T0 + 10, "lost", None);
    let note = entry("node-b", "take_over", until + 1);
    let stale = store.take_over(record.id, WORKER, T0 + LEASE, Phase::Unknown, Some(lost.clone()), note.clone());
    assert!(!stale.await.unwrap(), "the lease seen must be the current one");
    let other_owner = store.take_over(record.id, "node-c", until, Phase::Unknown, Some(lost.clone()), note.clone());
    assert!(!other_owner.await.unwrap());
    assert!(store.take_over(record.id, WORKER, until, Phase::Unknown, Some(lost.clone()), note.clone()).await.unwrap());
    assert!(
        !store.take_over(record.id, WORKER, until, Phase::Queued, None, note.clone()).await.unwrap(),
        "of two sweepers with the same view, one wins"
    );

    let taken = fetch(&store, record.id).await;
    assert_eq!(taken.phase(), Phase::Unknown);
    assert_eq!(taken.stop_reason, Some(StopReason::UnsafeReplay));
    assert_eq!((taken.lease, taken.in_flight), (None, None));
    assert_eq!(taken.attempts, vec![lost]);
    assert_eq!(taken.history, vec![note.clone()]);
    assert!(store.expired_leases(until + 1, 10).await.unwrap().is_empty());

    // A record with nothing in flight is queued again for any worker.
    let idle = in_progress(&store, request("default", "idle", BODY)).await;
    assert!(store.take_over(idle.id, WORKER, T0 + LEASE, Phase::Queued, None, note.clone()).await.unwrap());
    let requeued = fetch(&store, idle.id).await;
    assert_eq!((requeued.phase(), requeued.attempts.len(), requeued.stop_reason), (Phase::Queued, 0, None));
    assert!(store.claim(idle.id, "node-b", until + LEASE, until + 2).await.unwrap());

    // Past its deadline, it is freed instead.
    let late = in_progress(&store, request("default", "late", BODY)).await;
    assert!(store.take_over(late.id, WORKER, T0 + LEASE, Phase::Free, None, note).await.unwrap());
    let freed = fetch(&store, late.id).await;
    assert_eq!((freed.phase(), freed.stop_reason), (Phase::Free, Some(StopReason::Deadline)));
}

async fn two_concurrent_callers_claim_each_unclaimed_record_once(store: Arc<dyn Store>) {
    let mut ids = HashSet::new();
    for i in 0..24 {
        let new = request_on("payments", "default", &format!("orphan-{i}"), BODY, T0 + i);
        ids.insert(queued(&store, new).await.id);
    }
    // Queued after `idle_since`: its node may still claim it, so nobody else does.
    let fresh = queued(&store, request_on("payments", "default", "fresh", BODY, T0 + 5_000)).await;

    let callers: Vec<_> = ["node-a", "node-b"]
        .into_iter()
        .map(|owner| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut claimed = Vec::new();
                loop {
                    let batch = store.claim_unclaimed(owner, T0 + 60_000, T0 + 1_000, T0 + 6_000, 3).await.unwrap();
                    if batch.is_empty() {
                        return claimed;
                    }
                    assert!(batch.len() <= 3, "at most `limit` records per call");
                    for record in batch {
                        assert_eq!(record.phase(), Phase::InProgress);
                        assert_eq!(record.lease.as_ref().map(|l| l.owner.as_str()), Some(owner));
                        claimed.push(record.id);
                    }
                }
            })
        })
        .collect();
    let mut seen = Vec::new();
    for caller in callers {
        seen.extend(caller.await.unwrap());
    }
    let unique: HashSet<_> = seen.iter().copied().collect();
    assert_eq!(seen.len(), unique.len(), "no record is claimed twice");
    assert_eq!(unique, ids, "every idle record is claimed");
    assert_eq!(fetch(&store, fresh.id).await.phase(), Phase::Queued);
    assert!(store.claim_unclaimed("node-c", T0 + 60_000, T0 + 1_000, T0 + 7_000, 10).await.unwrap().is_empty());
}

async fn probes_are_due_after_settle_and_then_at_the_next_probe_time(store: Arc<dyn Store>) {
    let record = unknown(&store, request("default", "probe-me", BODY)).await;
    let became_unknown = record.updated_at;
    let settle = 5_000;
    let due = |now: Millis| {
        let store = store.clone();
        async move { store.probes_due("payments", settle, now, 10).await.unwrap().iter().map(|r| r.id).collect::<Vec<_>>() }
    };
    assert!(due(became_unknown + settle - 1).await.is_empty(), "not before settle");
    assert_eq!(due(became_unknown + settle).await, vec![record.id]);
    assert!(store.probes_due("refunds", settle, became_unknown + settle, 10).await.unwrap().is_empty());

    let next = became_unknown + 20_000;
    let asked = entry("probe", "still_unknown", became_unknown + settle);
    let probed = applied(store.probed(record.id, None, next, asked.clone()).await.unwrap());
    assert_eq!((probed.phase(), probed.probe_count, probed.next_probe_at), (Phase::Unknown, 1, Some(next)));
    assert_eq!(probed.history, vec![asked.clone()]);
    assert!(due(next - 1).await.is_empty(), "the next probe waits for its time");
    assert_eq!(due(next).await, vec![record.id]);

    let answered = entry("probe", "executed", next);
    let settled = applied(
        store
            .probed(record.id, Some(Resolution::Executed(response(200, b"{}"))), next + 1, answered.clone())
            .await
            .unwrap(),
    );
    assert_eq!((settled.phase(), settled.probe_count, settled.next_probe_at), (Phase::Done, 2, None));
    assert_eq!(settled.history, vec![asked, answered.clone()]);
    assert!(due(next + 60_000).await.is_empty());
    refused(store.probed(record.id, None, next + 1, answered.clone()).await.unwrap());
    assert!(matches!(store.probed(Uuid::new_v4(), None, next, answered).await.unwrap(), Action::Missing));
}

async fn listing_filters_and_pages_through_every_record_exactly_once(store: Arc<dyn Store>) {
    let mut all = Vec::new();
    for i in 0..17i64 {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let route = if i % 3 == 0 { "refunds" } else { "payments" };
        // Three records share each creation time: the id breaks the tie.
        let record = queued(&store, request_on(route, tenant, &format!("k{i}"), BODY, T0 + i / 3)).await;
        if i % 4 == 0 {
            assert!(store.claim(record.id, WORKER, T0 + LEASE, T0 + 100).await.unwrap());
        }
        all.push(fetch(&store, record.id).await);
    }
    all.sort_by_key(|r| (r.created_at, r.id));

    let page_through = |filter: ListFilter| {
        let store = store.clone();
        async move {
            let mut filter = filter;
            let mut ids = Vec::new();
            loop {
                let page = store.list(&filter).await.unwrap();
                assert!(page.items.len() <= filter.limit as usize);
                ids.extend(page.items.iter().map(|r| r.id));
                match page.next_cursor {
                    // The cursor survives a trip through its client-facing token.
                    Some(cursor) => filter.cursor = Some(Cursor::decode(&cursor.encode()).unwrap()),
                    None => return ids,
                }
            }
        }
    };
    let expect = |keep: &dyn Fn(&Record) -> bool| all.iter().filter(|r| keep(r)).map(|r| r.id).collect::<Vec<_>>();

    assert_eq!(page_through(ListFilter { limit: 4, ..ListFilter::default() }).await, expect(&|_| true));
    assert_eq!(page_through(ListFilter { limit: 1, ..ListFilter::default() }).await, expect(&|_| true));
    assert_eq!(page_through(ListFilter { limit: 17, ..ListFilter::default() }).await, expect(&|_| true));
    let by_tenant = ListFilter { tenant: Some("acme".into()), limit: 2, ..ListFilter::default() };
    assert_eq!(page_through(by_tenant).await, expect(&|r| r.tenant == "acme"));
    let by_state = ListFilter { state: Some(State::InProgress), limit: 3, ..ListFilter::default() };
    let in_progress = expect(&|r| r.state == State::InProgress);
    assert_eq!(in_progress.len(), 5);
    assert_eq!(page_through(by_state).await, in_progress);
    let combined = ListFilter {
        state: Some(State::NotStarted),
        route: Some("refunds".into()),
        tenant: Some("globex".into()),
        limit: 2,
        cursor: None,
    };
    let wanted = expect(&|r| r.state == State::NotStarted && r.route == "refunds" && r.tenant == "globex");
    assert!(!wanted.is_empty());
    assert_eq!(page_through(combined).await, wanted);
    let nobody = ListFilter { tenant: Some("initech".into()), limit: 5, ..ListFilter::default() };
    assert!(page_through(nobody).await.is_empty());
}

async fn records_are_counted_by_phase(store: Arc<dyn Store>) {
    assert!(store.count_by_phase().await.unwrap().iter().all(|(_, n)| *n == 0));
    for i in 0..3 {
        queued(&store, request("default", &format!("queued-{i}"), BODY)).await;
    }
    for i in 0..2 {
        in_progress(&store, request("default", &format!("running-{i}"), BODY)).await;
    }
    done(&store, request("default", "done", BODY), T0 + 100).await;
    unknown(&store, request("default", "unknown", BODY)).await;
    free(&store, request("default", "free", BODY)).await;

    let mut counts: HashMap<&str, u64> = HashMap::new();
    for (phase, n) in store.count_by_phase().await.unwrap() {
        *counts.entry(phase.as_str()).or_default() += n;
    }
    counts.retain(|_, n| *n > 0);
    let expected = HashMap::from([("queued", 3), ("in_progress", 2), ("done", 1), ("unknown", 1), ("free", 1)]);
    assert_eq!(counts, expected);
}

async fn sweeping_deletes_only_done_records_finished_before_the_cutoff(store: Arc<dyn Store>) {
    let old_a = done(&store, request("default", "old-a", BODY), T0 + 1_000).await;
    let old_b = done(&store, request("default", "old-b", BODY), T0 + 1_100).await;
    let recent = done(&store, request("default", "recent", BODY), T0 + 3_000).await;
    let unsettled = unknown(&store, request("default", "unknown", BODY)).await;
    let waiting = queued(&store, request("default", "queued", BODY)).await;
    let released = free(&store, request("default", "free", BODY)).await;

    let cutoff = T0 + 2_000;
    assert_eq!(store.sweep_done(cutoff, 1).await.unwrap(), 1, "at most `limit` per call");
    assert_eq!(store.sweep_done(cutoff, 1).await.unwrap(), 1);
    assert_eq!(store.sweep_done(cutoff, 1).await.unwrap(), 0);
    for gone in [old_a.id, old_b.id] {
        assert!(store.get(gone).await.unwrap().is_none());
    }
    for kept in [recent.id, unsettled.id, waiting.id, released.id] {
        fetch(&store, kept).await;
    }
    assert_eq!(store.sweep_done(T0 + 3_000, 100).await.unwrap(), 0, "finished at the cutoff is kept");
    assert_eq!(store.sweep_done(T0 + 3_001, 100).await.unwrap(), 1);
    assert!(store.get(recent.id).await.unwrap().is_none());
}

// ---- PostgreSQL only ----------------------------------------------------------------------------

/// Waits for `want`, skipping other notices; fails after ten seconds.
async fn expect_notice(notices: &mut broadcast::Receiver<Notice>, want: Notice) {
    let wait = async {
        loop {
            match notices.recv().await {
                Ok(notice) if notice == want => return,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => panic!("the notice channel closed"),
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), wait).await.is_err() {
        panic!("no {want:?} within ten seconds");
    }
}

async fn notices_announce_queued_and_settled_records_to_every_process(store: Arc<dyn Store>, url: String) {
    // Another process on the same database: it hears of changes made through `store`.
    let other = store::open(&url).await.unwrap();
    let mut here = store.notices().expect("PostgreSQL announces changes");
    let mut there = other.notices().expect("PostgreSQL announces changes");

    let record = queued(&store, request("default", "announced", BODY)).await;
    expect_notice(&mut here, Notice::Queued(record.id)).await;
    expect_notice(&mut there, Notice::Queued(record.id)).await;

    // A request waiting elsewhere asks to hear when it settles: that one is announced.
    other.watch(record.id).await.unwrap();
    assert!(store.claim(record.id, WORKER, T0 + LEASE, T0 + 1).await.unwrap());
    let lease = store
        .attempt_ended(
            record.id,
            WORKER,
            Some(attempt(1, T0 + 10, "success", Some(201))),
            AfterAttempt::Done(StopReason::Success, response(201, b"{}")),
            T0 + 20,
        )
        .await
        .unwrap();
    assert!(lease.is_held());
    expect_notice(&mut there, Notice::Settled(record.id)).await;

    // A record nobody watches settles quietly: announcing every one would serialise commits.
    let mut audit = other.notices().expect("PostgreSQL announces changes");
    let quiet = in_progress(&store, request("default", "quiet", BODY)).await;
    let done = AfterAttempt::Done(StopReason::Success, response(201, b"{}"));
    store.attempt_ended(quiet.id, WORKER, None, done, T0 + 20).await.unwrap();

    // A queued record cancelled settles too, and an operator's retry queues again.
    let cancelled = queued(&store, request("default", "cancelled", BODY)).await;
    other.watch(cancelled.id).await.unwrap();
    assert!(matches!(store.cancel(cancelled.id, entry("client", "cancel", T0)).await.unwrap(), Cancelled::Dequeued(_)));
    expect_notice(&mut there, Notice::Settled(cancelled.id)).await;
    // Notices arrive in commit order: had the quiet one been announced, it would be here by now.
    let mut heard = Vec::new();
    while let Ok(n) = audit.try_recv() {
        heard.push(n);
    }
    assert!(heard.contains(&Notice::Settled(cancelled.id)), "{heard:?}");
    assert!(!heard.contains(&Notice::Settled(quiet.id)), "an unwatched record was announced: {heard:?}");
    let retried = in_progress(&store, request("default", "retried", BODY)).await;
    other.watch(retried.id).await.unwrap();
    let unsure = AfterAttempt::Unknown(StopReason::UnsafeReplay);
    store
        .attempt_ended(retried.id, WORKER, Some(attempt(1, T0 + 10, "ambiguous", None)), unsure, T0 + 100)
        .await
        .unwrap();
    expect_notice(&mut there, Notice::Settled(retried.id)).await;
    applied(store.retry(retried.id, T0 + 60_000, entry("operator", "retry", T0 + 200)).await.unwrap());
    expect_notice(&mut there, Notice::Queued(retried.id)).await;
}
