//! Fencing: every claim of a record gets a token of its own, and every write made under a claim
//! is checked against the record's latest token, not against the name of the node that holds it.
//! A claim that was taken over and given again — to another node, or to the same one — can
//! neither mark an attempt (so it sends nothing), nor renew, nor store an outcome; the one
//! exception is the late outcome of the attempt that was in flight when a take-over moved the
//! record to `unknown`, which settles it.

use super::*;

/// Its lease ran out: a take-over queues it again (as for a replay-safe route, when an attempt
/// was in flight).
async fn taken_back_to_the_queue(store: &Arc<dyn Store>, record: &Record, at: Timestamp) {
    let lease = record.lease.clone().expect("a claimed record has a lease");
    let take_over = TakeOver {
        id: record.id,
        expired: lease,
        claim: record.claim,
        to: TakeOverTo::Queued,
        in_flight: record.in_flight.map(|(number, _)| number),
        lost: None,
        entry: entry("node:node-b", HistoryAction::TakeOver(Phase::Queued), at),
    };
    assert!(store.take_over(take_over).await.unwrap(), "the expired lease is taken over");
}

/// Every write a worker makes under `holder`'s claim, each answered `Lost` and none of them
/// changing `record`.
async fn assert_every_write_refused(store: &Arc<dyn Store>, record: &Record, holder: &Holder, at: Timestamp) {
    let before = fetch(store, record.id).await;
    let started = AttemptStarted {
        id: record.id,
        holder: holder.clone(),
        number: 1,
        started_at: at,
        lease: LEASE,
        reach: REACH,
        policy_version: VERSION.into(),
    };
    assert_eq!(store.attempt_started(started).await.unwrap(), LeaseStatus::Lost, "a stale claim marks no attempt");
    let renew = Renew { id: record.id, holder: holder.clone(), lease: LEASE, now: at };
    assert_eq!(store.renew(renew).await.unwrap(), LeaseStatus::Lost, "nor renews");
    let outcomes = [
        (Some(attempt(1, at, "success", Some(201))), AttemptEnd::Done(StopReason::Success, response(201, b"twice"))),
        (Some(attempt(1, at, "not_executed", Some(503))), AttemptEnd::Wait { not_before: at + ms(100) }),
        (None, AttemptEnd::Free(StopReason::Cancelled)),
        (None, AttemptEnd::Release),
    ];
    for (attempt, then) in outcomes {
        let ended = AttemptEnded { id: record.id, holder: holder.clone(), attempt, then, stream: None, now: at };
        assert_eq!(store.attempt_ended(ended).await.unwrap(), LeaseStatus::Lost, "nor stores an outcome");
    }
    let after = fetch(store, record.id).await;
    assert_eq!(format!("{after:#?}"), format!("{before:#?}"), "a stale claim's writes change nothing");
}

/// Claim t1, taken back to the queue, claimed again as t2 by a node of the same name: every
/// write under t1 is refused, t2's hold. So for a single claim, a bulk claim and a claimed
/// admission alike.
pub(super) async fn a_claim_taken_over_and_given_again_fences_off_every_write_of_the_old_one(backend: Backend) {
    let (store, _db) = store_on(backend).await;

    // A single claim.
    let record = queued(&store, request("default", "single", BODY)).await;
    assert_eq!(record.claim, ClaimToken(0), "a queued record was never claimed");
    let claim = |now: Timestamp| ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE, now };
    let t1 = store.claim(claim(T0 + ms(1))).await.unwrap().expect("queued: claimed");
    let first = fetch(&store, record.id).await;
    assert_eq!((t1, first.claim), (ClaimToken(1), t1));
    taken_back_to_the_queue(&store, &first, T0 + LEASE + ms(2)).await;
    let t2 = store.claim(claim(T0 + LEASE + ms(3))).await.unwrap().expect("queued again: claimed again");
    assert_eq!(t2, ClaimToken(2), "a new claim, a new token");
    let stale = Holder { owner: WORKER.into(), token: t1 };
    assert_every_write_refused(&store, &record, &stale, T0 + LEASE + ms(4)).await;
    let current = Holder { owner: WORKER.into(), token: t2 };
    let started = AttemptStarted { holder: current.clone(), ..started(&record, 1, T0 + LEASE + ms(5), T0 + 3 * LEASE) };
    assert!(store.attempt_started(started).await.unwrap().is_held(), "the new claim marks its attempt");
    let renew = Renew { id: record.id, holder: current.clone(), lease: 2 * LEASE, now: T0 + LEASE };
    assert!(store.renew(renew).await.unwrap().is_held());
    let done = AttemptEnded {
        id: record.id,
        holder: current,
        attempt: Some(attempt(1, T0 + LEASE + ms(5), "success", Some(201))),
        then: AttemptEnd::Done(StopReason::Success, response(201, b"once")),
        stream: None,
        now: T0 + LEASE + ms(20),
    };
    assert!(store.attempt_ended(done).await.unwrap().is_held());
    let settled = fetch(&store, record.id).await;
    assert_eq!((settled.phase(), settled.attempts.len()), (Phase::Done, 1));
    assert_eq!(settled.response.map(|r| r.body), Some(Bytes::from_static(b"once")));

    // A bulk claim of records nobody claimed.
    let orphan = queued(&store, request("default", "orphan", BODY)).await;
    let bulk = |now: Timestamp| ClaimUnclaimed { owner: WORKER.into(), lease: LEASE, idle_since: now, now, limit: 1 };
    let first = store.claim_unclaimed(bulk(T0 + ms(10))).await.unwrap().remove(0);
    assert_eq!((first.id, first.claim), (orphan.id, ClaimToken(1)));
    taken_back_to_the_queue(&store, &first, T0 + LEASE + ms(11)).await;
    let second = store.claim_unclaimed(bulk(T0 + LEASE + ms(12))).await.unwrap().remove(0);
    assert_eq!((second.id, second.claim), (orphan.id, ClaimToken(2)));
    assert_every_write_refused(&store, &orphan, &holder(&first, WORKER), T0 + LEASE + ms(13)).await;
    assert!(store.renew(Renew { lease: 3 * LEASE, ..renewal(&second) }).await.unwrap().is_held());

    // A claimed admission.
    let claim = Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH };
    let new =
        NewRecord { claim: Some(claim), policy_version: Some(VERSION.into()), ..request("default", "express", BODY) };
    let admitted = created(store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap());
    assert_eq!(admitted.claim, ClaimToken::FIRST, "claimed at insert: its first claim");
    assert_eq!(fetch(&store, admitted.id).await.claim, ClaimToken::FIRST);
    taken_back_to_the_queue(&store, &admitted, T0 + LEASE + ms(1)).await;
    let again = ClaimQueued { id: admitted.id, owner: WORKER.into(), lease: 2 * LEASE, now: T0 + LEASE };
    assert_eq!(store.claim(again).await.unwrap(), Some(ClaimToken(2)));
    assert_every_write_refused(&store, &admitted, &holder(&admitted, WORKER), T0 + LEASE + ms(2)).await;
}

fn renewal(record: &Record) -> Renew {
    Renew { id: record.id, holder: holder(record, WORKER), lease: LEASE, now: T0 }
}

/// Claimed, attempt 1 marked as about to be sent, and the lease expired with it in flight: a
/// take-over moved it to `unknown`, attempt 1 recorded as lost.
async fn lost_in_flight(store: &Arc<dyn Store>, key: &str) -> Record {
    let record = in_progress(store, request("default", key, BODY)).await;
    assert!(store.attempt_started(started(&record, 1, T0 + ms(10), T0 + LEASE)).await.unwrap().is_held());
    let take_over = TakeOver {
        id: record.id,
        expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE },
        claim: record.claim,
        to: TakeOverTo::Unknown(StopReason::UnsafeReplay),
        in_flight: Some(1),
        lost: Some(attempt(1, T0 + ms(10), "lost", None)),
        entry: entry("node:node-b", HistoryAction::TakeOver(Phase::Unknown), T0 + LEASE + ms(1)),
    };
    assert!(store.take_over(take_over).await.unwrap());
    let unknown = fetch(store, record.id).await;
    assert_eq!((unknown.phase(), unknown.claim), (Phase::Unknown, record.claim));
    unknown
}

/// The outcome of attempt `number` under `record`'s claim, arriving at `now`.
fn late(record: &Record, number: u32, outcome: &str, status: Option<u16>, then: AttemptEnd) -> AttemptEnded {
    AttemptEnded {
        id: record.id,
        holder: holder(record, "node-a"),
        attempt: Some(attempt(number, T0 + ms(10), outcome, status)),
        then,
        stream: None,
        now: T0 + LEASE + ms(500),
    }
}

/// A node paused between marking attempt 1 and sending it, past its lease; a survivor moved the
/// record to `unknown` (it could not know). The paused node resumes, sends, and its outcome for
/// that same attempt settles the record; any other write of the old claim is still refused.
pub(super) async fn a_late_outcome_of_the_attempt_lost_in_flight_settles_its_unknown_record(backend: Backend) {
    let (store, _db) = store_on(backend).await;

    // A final answer: done, with the upstream's response, the lost attempt replaced by it.
    let record = lost_in_flight(&store, "answered").await;
    let answered = AttemptEnd::Done(StopReason::Success, response(201, b"{\"id\":\"ch_1\"}"));
    let ended = late(&record, 1, "success", Some(201), answered.clone());
    assert_eq!(store.attempt_ended(ended).await.unwrap(), LeaseStatus::Lost, "the worker's claim is over all the same");
    let settled = fetch(&store, record.id).await;
    assert_eq!(settled.phase(), Phase::Done);
    assert_eq!(settled.response.as_ref().map(|r| (r.status, r.body.clone())), Some((201, "{\"id\":\"ch_1\"}".into())));
    assert_eq!(settled.attempts, vec![attempt(1, T0 + ms(10), "success", Some(201))]);
    let noted = settled.history.last().expect("the late outcome is in the history");
    assert_eq!(
        (noted.actor.to_string().as_str(), noted.action),
        ("node:node-a", HistoryAction::LateOutcome(Phase::Done))
    );
    // Once settled, nothing of the old claim applies again.
    let again = late(&record, 1, "success", Some(201), answered.clone());
    store.attempt_ended(again).await.unwrap();
    assert_eq!(format!("{:#?}", fetch(&store, record.id).await), format!("{settled:#?}"));

    // An answer that says nothing executed: the key is free.
    let record = lost_in_flight(&store, "refused").await;
    let retry = AttemptEnd::Wait { not_before: T0 + LEASE + ms(900) };
    store.attempt_ended(late(&record, 1, "not_executed", Some(503), retry)).await.unwrap();
    let freed = fetch(&store, record.id).await;
    assert_eq!((freed.phase(), freed.response.is_none()), (Phase::Free, true));
    assert_eq!(freed.attempts[0].outcome, AttemptOutcome::NotExecuted);

    // An answer that cannot tell: still unknown, but with what was seen instead of "lost" — and
    // so no second late outcome can apply.
    let record = lost_in_flight(&store, "unsure").await;
    let unsure = AttemptEnd::Unknown(StopReason::UnsafeReplay);
    store.attempt_ended(late(&record, 1, "ambiguous", None, unsure)).await.unwrap();
    let still = fetch(&store, record.id).await;
    assert_eq!((still.phase(), still.attempts[0].outcome), (Phase::Unknown, AttemptOutcome::Ambiguous));
    store.attempt_ended(late(&record, 1, "success", Some(201), answered.clone())).await.unwrap();
    assert_eq!(fetch(&store, record.id).await.phase(), Phase::Unknown, "only the lost attempt's outcome settles");

    // Not another attempt's outcome, nor one without an attempt.
    let record = lost_in_flight(&store, "other-attempt").await;
    store.attempt_ended(late(&record, 2, "success", Some(201), answered.clone())).await.unwrap();
    let no_attempt = AttemptEnded { attempt: None, ..late(&record, 1, "success", Some(201), answered.clone()) };
    store.attempt_ended(no_attempt).await.unwrap();
    assert_eq!(fetch(&store, record.id).await.phase(), Phase::Unknown);

    // Not once an operator re-drove it and it was claimed again: the old claim is fenced off.
    let record = lost_in_flight(&store, "redriven").await;
    let retry =
        Retry { id: record.id, deadline_at: T0 + ms(90_000), entry: entry("ops", HistoryAction::Retry, T0 + LEASE) };
    applied(store.retry(retry).await.unwrap());
    let claim = ClaimQueued { id: record.id, owner: WORKER.into(), lease: 2 * LEASE, now: T0 + LEASE };
    let t2 = store.claim(claim).await.unwrap().expect("queued again by the operator");
    store.attempt_ended(late(&record, 1, "success", Some(201), answered.clone())).await.unwrap();
    let redriven = fetch(&store, record.id).await;
    assert_eq!((redriven.phase(), redriven.claim, redriven.response.is_none()), (Phase::InProgress, t2, true));

    // Not once an operator settled it.
    let record = lost_in_flight(&store, "resolved").await;
    let resolve = Resolve {
        id: record.id,
        resolution: Resolution::NotExecuted,
        entry: entry("ops", HistoryAction::ResolveNotExecuted, T0 + LEASE + ms(2)),
    };
    applied(store.resolve(resolve).await.unwrap());
    store.attempt_ended(late(&record, 1, "success", Some(201), answered)).await.unwrap();
    assert_eq!(fetch(&store, record.id).await.phase(), Phase::Free);
}

/// A probe reads an `unknown` record; meanwhile an operator re-drives it and its new execution
/// ends `unknown` again. The probe's answer was about the first execution: it settles nothing.
pub(super) async fn a_probe_of_an_earlier_claim_does_not_settle_a_later_execution(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let read = lost_in_flight(&store, "probed").await;
    let retry =
        Retry { id: read.id, deadline_at: T0 + ms(90_000), entry: entry("ops", HistoryAction::Retry, T0 + LEASE) };
    applied(store.retry(retry).await.unwrap());
    let claim = ClaimQueued { id: read.id, owner: WORKER.into(), lease: 2 * LEASE, now: T0 + LEASE };
    let t2 = store.claim(claim).await.unwrap().expect("queued again by the operator");
    let current = Holder { owner: WORKER.into(), token: t2 };
    let started = AttemptStarted { holder: current.clone(), ..started(&read, 2, T0 + LEASE, T0 + 3 * LEASE) };
    assert!(store.attempt_started(started).await.unwrap().is_held());
    let unsure = AttemptEnded {
        id: read.id,
        holder: current,
        attempt: Some(attempt(2, T0 + LEASE, "ambiguous", None)),
        then: AttemptEnd::Unknown(StopReason::UnsafeReplay),
        stream: None,
        now: T0 + LEASE + ms(100),
    };
    assert!(store.attempt_ended(unsure).await.unwrap().is_held());

    let probed = |claim, resolution| Probed {
        id: read.id,
        claim,
        resolution,
        asked_at: T0 + LEASE + ms(200),
        next_probe_at: T0 + ms(99_000),
        entry: entry("probe", HistoryAction::Probe, T0 + LEASE + ms(200)),
    };
    let executed = || Some(Resolution::Executed(response(200, b"{}")));
    let stale = refused(store.probed(probed(read.claim, executed())).await.unwrap());
    assert_eq!((stale.phase(), stale.probe_count), (Phase::Unknown, 0));
    refused(store.probed(probed(read.claim, None)).await.unwrap());
    let settled = applied(store.probed(probed(t2, executed())).await.unwrap());
    assert_eq!((settled.phase(), settled.probe_count), (Phase::Done, 1));
}
