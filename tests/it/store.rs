//! The `Store` contract, case by case, on both backends: every case below runs once on SQLite
//! (`sqlite::<case>`) and once on PostgreSQL (`postgres::<case>`), each on an empty database.
//! Times are fixed numbers, not the clock: the store takes every time it uses as an argument.

mod admission;
mod execution;
mod fencing;
mod notices;
mod phases;
mod protocol;
mod reconciliation;
mod recorded;
mod switches;
mod sync;
mod tls;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{Backend, Db};
use bytes::Bytes;
use idem::domain::fingerprint::Fingerprint;
use idem::domain::key::IdempotencyKey;
use idem::domain::{Actor, StopReason};
use idem::domain::{
    AttemptError, AttemptOutcome, ClaimToken, HistoryAction, Holder, Phase, RecordId, State, Timestamp,
};
use idem::record::{header_text, Attempt, HistoryEntry, Record, StoredRequest, StoredResponse, StreamFacts};
use idem::store::{
    self, Action, Admission, Admit, AttemptEnd, AttemptEnded, AttemptStarted, Cancel, Cancelled, Claim, ClaimQueued,
    ClaimUnclaimed, Cursor, LeaseStatus, ListFilter, NewRecord, Notice, Probed, ProbesDue, Renew, Resolution, Resolve,
    Retry, RouteSweep, Store, Sweep, SweepPlan, TakeOver, TakeOverTo,
};
use tokio::sync::broadcast;
use uuid::Uuid;

use admission::*;
use execution::*;
use fencing::*;
use notices::*;
use phases::*;
use reconciliation::*;
use switches::*;

/// A store on an empty database of `backend`, which goes when the [`Db`] is dropped.
async fn store_on(backend: Backend) -> (Arc<dyn Store>, Db) {
    let db = Db::new(backend).await;
    (db.store().await, db)
}

crate::common::both_stores!(
    admit_creates_a_record_then_returns_it_for_the_same_key,
    of_64_concurrent_admits_of_one_key_exactly_one_creates_the_record,
    concurrent_admits_of_many_keys_create_each_once_and_answer_what_they_stored,
    two_tenants_with_one_key_have_independent_records,
    a_free_record_is_requeued_by_the_same_request_and_kept_from_another,
    a_done_record_past_retention_is_replaced_with_a_new_id,
    a_queued_record_is_claimed_once,
    a_worker_that_does_not_hold_the_lease_is_told_it_lost_it,
    a_claim_taken_over_and_given_again_fences_off_every_write_of_the_old_one,
    a_late_outcome_of_the_attempt_lost_in_flight_settles_its_unknown_record,
    a_probe_of_an_earlier_claim_does_not_settle_a_later_execution,
    a_streamed_answers_facts_are_stored_with_its_outcome,
    a_done_attempt_stores_the_response_byte_for_byte_and_the_attempts,
    cancelling_a_queued_record_frees_it,
    cancelling_an_in_progress_record_asks_its_worker_to_stop,
    resolve_and_retry_apply_only_to_unknown_records_and_keep_history,
    take_over_is_a_compare_and_set_on_the_expired_lease,
    a_mark_landing_between_a_sweeps_read_and_its_write_refuses_the_take_over,
    a_record_whose_worker_keeps_dying_is_stopped_at_the_take_over_cap,
    the_take_over_count_survives_a_requeue_and_starts_afresh_for_a_new_operation_or_an_operator_retry,
    two_concurrent_callers_claim_each_unclaimed_record_once,
    probes_are_due_after_settle_and_then_at_the_next_probe_time,
    listing_filters_and_pages_through_every_record_exactly_once,
    records_are_counted_by_phase,
    the_count_by_phase_follows_every_change_of_state,
    each_state_is_listed_in_order_from_its_own_index,
    sweeping_deletes_only_done_records_finished_before_the_cutoff,
    past_retention_a_done_record_becomes_a_tombstone_that_refuses_its_own_request,
    another_request_under_a_spent_key_and_a_late_one_execute,
    an_admission_with_a_claim_is_recorded_in_progress_with_its_first_attempt_marked,
    each_attempt_keeps_the_policy_version_it_was_sent_under,
    a_canarys_sides_count_settled_executions_by_policy_version,
    switches_are_set_listed_replaced_and_cleared_with_their_audit,
    an_expired_switch_is_not_active_not_replaced_and_not_cleared_but_kept,
    of_concurrent_sets_of_one_scope_and_action_one_stays_active,
);

/// What only PostgreSQL offers.
mod postgres_only {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn notices_announce_queued_and_settled_records_to_every_process() {
        if crate::common::backend::postgres_server_url().is_none() {
            return crate::common::backend::skipped(
                "postgres_only::notices_announce_queued_and_settled_records_to_every_process",
            );
        }
        super::notices_announce_queued_and_settled_records_to_every_process(super::Backend::Postgres).await
    }
}

// ---- fixtures -----------------------------------------------------------------------------------

/// An arbitrary fixed instant; tests move time by adding to it.
const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

/// A span of `n` milliseconds, to move time on from [`T0`].
const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
const BODY: &[u8] = br#"{"amount":42,"currency":"eur"}"#;
const WORKER: &str = "node-a/worker-1";
const LEASE: Duration = ms(15_000);
/// How long after its mark a test's attempt may still reach the upstream: short, so that the
/// actions at `T0 + 100` and later find its bound passed.
const REACH: Duration = ms(50);
/// A policy version, as a route's policy would give it.
const VERSION: &str = "0123456789ab";

/// A key the ingress would have accepted.
fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::parse(text).unwrap()
}

fn request(tenant: &str, key: &str, body: &[u8]) -> NewRecord {
    request_on("payments", tenant, key, body, T0)
}

fn request_on(route: &str, tenant: &str, key: &str, body: &[u8], now: Timestamp) -> NewRecord {
    let path = format!("/{route}");
    NewRecord {
        id: RecordId::new(),
        tenant: tenant.into(),
        key: self::key(key),
        route: route.into(),
        method: http::Method::POST,
        path: path.clone(),
        query: "currency=eur".into(),
        fingerprint: Fingerprint::of(route, "POST", &path, "currency=eur", Some(b"application/json"), body),
        request: StoredRequest {
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::copy_from_slice(body),
        },
        deadline_at: now + ms(30_000),
        now,
        policy_version: None,
        claim: None,
        tombstone_cutoff: None,
    }
}

fn entry(actor: &str, action: HistoryAction, at: Timestamp) -> HistoryEntry {
    HistoryEntry { at, actor: Actor::parse(actor), action, note: Some(format!("{actor} {action}")) }
}

/// Attempt `number` of `record` marked as about to be sent at `at`, by this test's worker, its
/// lease running until `lease_until`; it may reach the upstream for [`REACH`] after its mark.
fn started(record: &Record, number: u32, at: Timestamp, lease_until: Timestamp) -> AttemptStarted {
    AttemptStarted {
        id: record.id,
        holder: holder(record, WORKER),
        number,
        started_at: at,
        lease: lease_until - at,
        reach: REACH,
        policy_version: VERSION.into(),
    }
}

fn attempt(number: u32, started_at: Timestamp, outcome: &str, status: Option<u16>) -> Attempt {
    Attempt {
        number,
        started_at,
        duration_ms: 12,
        outcome: AttemptOutcome::parse(outcome).expect("an attempt outcome"),
        status,
        error: status.is_none().then_some(AttemptError::TimedOut),
        wait_ms: if number == 1 { 0 } else { 250 },
        policy_version: Some(VERSION.into()),
        retry_after_ms: None,
        unreachable: status.is_none().then(|| "route payments: the connection was refused".into()),
        detail: status.is_none().then(|| "route payments: connection refused".into()),
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

async fn fetch(store: &Arc<dyn Store>, id: RecordId) -> Record {
    store.get(id).await.unwrap().unwrap_or_else(|| panic!("record {id} is missing"))
}

async fn queued(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    created(store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap())
}

/// A record claimed by [`WORKER`] with a lease until `T0 + LEASE`.
async fn in_progress(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    let record = queued(store, new).await;
    assert!(store
        .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(1) })
        .await
        .unwrap()
        .is_some());
    fetch(store, record.id).await
}

/// A record whose first attempt ended ambiguously at `T0 + 100` on a route that is not
/// replay-safe.
async fn unknown(store: &Arc<dyn Store>, new: NewRecord) -> Record {
    let record = in_progress(store, new).await;
    let lease = store.attempt_started(started(&record, 1, T0 + ms(10), T0 + LEASE)).await.unwrap();
    assert!(lease.is_held());
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: Some(attempt(1, T0 + ms(10), "ambiguous", None)),
            then: AttemptEnd::Unknown(StopReason::UnsafeReplay),
            now: T0 + ms(100),
            stream: None,
        })
        .await
        .unwrap();
    assert!(lease.is_held());
    let record = fetch(store, record.id).await;
    assert_eq!(record.phase(), Phase::Unknown);
    record
}

/// A record answered `201` at `done_at`.
async fn done(store: &Arc<dyn Store>, new: NewRecord, done_at: Timestamp) -> Record {
    let record = in_progress(store, new).await;
    assert!(store.attempt_started(started(&record, 1, T0 + ms(10), T0 + LEASE)).await.unwrap().is_held());
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: Some(attempt(1, T0 + ms(10), "success", Some(201))),
            then: AttemptEnd::Done(StopReason::Success, response(201, b"{\"ok\":true}")),
            now: done_at,
            stream: None,
        })
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
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: None,
            then: AttemptEnd::Free(StopReason::Deadline),
            now: T0 + ms(100),
            stream: None,
        })
        .await
        .unwrap();
    assert!(lease.is_held());
    let record = fetch(store, record.id).await;
    assert_eq!(record.phase(), Phase::Free);
    record
}

/// `owner` writing under `record`'s latest claim, as its worker would.
fn holder(record: &Record, owner: &str) -> Holder {
    Holder { owner: owner.into(), token: record.claim }
}

/// `owner` writing under a claim `record` was never given.
fn intruder(record: &Record, owner: &str) -> Holder {
    Holder { owner: owner.into(), token: ClaimToken(record.claim.0 + 1) }
}

/// Nodes started together on a fresh SQLite file all open it: the one that loses the race to a
/// migration finds it applied by the other, and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_started_together_on_a_fresh_sqlite_file_all_open_it() {
    for round in 0..20 {
        let dir = tempfile::TempDir::new().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let opened = futures_util::future::join_all((0..3).map(|_| store::open(&url))).await;
        for store in opened {
            assert!(store.is_ok(), "round {round}: {:?}", store.err());
        }
    }
}
