//! Executing a record under its lease, and the operator's actions on it.

use super::*;

pub(super) async fn a_queued_record_is_claimed_once(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = queued(&store, request("default", "claim", BODY)).await;
    assert!(store
        .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(1) })
        .await
        .unwrap()
        .is_some());
    assert!(store
        .claim(ClaimQueued { id: record.id, owner: "node-b/worker-1".into(), lease: LEASE - ms(2), now: T0 + ms(2) })
        .await
        .unwrap()
        .is_none());
    assert!(store
        .claim(ClaimQueued { id: RecordId::new(), owner: WORKER.into(), lease: LEASE - ms(2), now: T0 + ms(2) })
        .await
        .unwrap()
        .is_none());
    let record = fetch(&store, record.id).await;
    assert_eq!(record.phase(), Phase::InProgress);
    let lease = record.lease.expect("a claimed record has a lease");
    assert_eq!((lease.owner.as_str(), lease.expires_at), (WORKER, T0 + LEASE));
    assert_eq!(record.updated_at, T0 + ms(1));
}

pub(super) async fn a_worker_that_does_not_hold_the_lease_is_told_it_lost_it(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = in_progress(&store, request("default", "lease", BODY)).await;
    let thief = "node-b/worker-9";
    assert_eq!(
        store
            .attempt_started(AttemptStarted {
                id: record.id,
                holder: intruder(&record, thief),
                number: 1,
                started_at: T0 + ms(10),
                lease: ms(98_990),
                reach: REACH,
                policy_version: VERSION.into()
            })
            .await
            .unwrap(),
        LeaseStatus::Lost
    );
    assert_eq!(
        store
            .renew(Renew { id: record.id, holder: intruder(&record, thief), lease: ms(98_990), now: T0 + ms(10) })
            .await
            .unwrap(),
        LeaseStatus::Lost
    );
    let ended = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: intruder(&record, thief),
            attempt: Some(attempt(1, T0 + ms(10), "success", Some(200))),
            then: AttemptEnd::Done(StopReason::Success, response(200, b"stolen")),
            now: T0 + ms(20),
            stream: None,
        })
        .await
        .unwrap();
    assert_eq!(ended, LeaseStatus::Lost);
    let unchanged = fetch(&store, record.id).await;
    assert_eq!(unchanged.phase(), Phase::InProgress);
    assert_eq!(unchanged.lease, record.lease);
    assert!(unchanged.in_flight.is_none() && unchanged.attempts.is_empty() && unchanged.response.is_none());

    // The holder is told it holds it, and its lease moves.
    let held = store.attempt_started(started(&record, 1, T0 + ms(10), T0 + ms(20_000))).await.unwrap();
    assert_eq!(held, LeaseStatus::Held { cancel_requested: false });
    let record = fetch(&store, record.id).await;
    assert_eq!(record.in_flight, Some((1, T0 + ms(10))));
    assert_eq!(record.lease.as_ref().map(|l| l.expires_at), Some(T0 + ms(20_000)));
    assert_eq!(
        store
            .renew(Renew { id: record.id, holder: holder(&record, WORKER), lease: ms(24_989), now: T0 + ms(11) })
            .await
            .unwrap(),
        held
    );
    assert_eq!(fetch(&store, record.id).await.lease.map(|l| l.expires_at), Some(T0 + ms(25_000)));

    // Once settled, nobody holds it.
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: None,
            then: AttemptEnd::Unknown(StopReason::UnsafeReplay),
            now: T0 + ms(30),
            stream: None,
        })
        .await
        .unwrap();
    assert!(lease.is_held());
    assert_eq!(
        store
            .renew(Renew { id: record.id, holder: holder(&record, WORKER), lease: ms(29_969), now: T0 + ms(31) })
            .await
            .unwrap(),
        LeaseStatus::Lost
    );
}

pub(super) async fn a_done_attempt_stores_the_response_byte_for_byte_and_the_attempts(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let binary_request: Vec<u8> = (0..=255u8).rev().collect();
    let mut new = request("default", "bytes", &binary_request);
    new.request.headers.push(("x-raw".into(), header_text(&[0x80, 0xfe, b' ', b'x'])));
    let record = in_progress(&store, new.clone()).await;
    assert_eq!(record.request, new.request, "the request is kept byte for byte");

    let first = attempt(1, T0 + ms(10), "not_executed", Some(503));
    assert!(store.attempt_started(started(&record, 1, T0 + ms(10), T0 + LEASE)).await.unwrap().is_held());
    let wait = AttemptEnd::Wait { not_before: T0 + ms(250) };
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: Some(first.clone()),
            then: wait,
            now: T0 + ms(30),
            stream: None,
        })
        .await
        .unwrap();
    assert!(lease.is_held());
    let waiting = fetch(&store, record.id).await;
    assert_eq!(waiting.phase(), Phase::InProgress, "a wait keeps the record");
    assert_eq!(waiting.not_before, Some(T0 + ms(250)), "and when the next attempt may start");
    assert_eq!(waiting.lease.as_ref().map(|l| l.owner.as_str()), Some(WORKER), "and the lease");
    assert_eq!(waiting.in_flight, None, "the attempt's outcome is recorded");
    assert_eq!(waiting.attempts, vec![first.clone()]);

    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend_from_slice(&[0xc3, 0x28, 0x00, 0xff, 0xfe]);
    let answer = response(201, &body);
    let second = attempt(2, T0 + ms(300), "success", Some(201));
    assert!(store.attempt_started(started(&record, 2, T0 + ms(300), T0 + LEASE)).await.unwrap().is_held());
    assert_eq!(fetch(&store, record.id).await.in_flight, Some((2, T0 + ms(300))));
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: Some(second.clone()),
            then: AttemptEnd::Done(StopReason::Success, answer.clone()),
            now: T0 + ms(320),
            stream: None,
        })
        .await
        .unwrap();
    assert_eq!(lease, LeaseStatus::Held { cancel_requested: false });

    let done = fetch(&store, record.id).await;
    assert_eq!(done.phase(), Phase::Done);
    assert_eq!(done.response, Some(answer), "status, headers and body exactly as received");
    assert_eq!(done.attempts, vec![first, second]);
    assert_eq!(done.stop_reason, Some(StopReason::Success));
    assert_eq!((done.lease, done.in_flight, done.updated_at), (None, None, T0 + ms(320)));
    assert_eq!(store.lookup(&"default".into(), &key("bytes")).await.unwrap().unwrap().response, done.response);
}

pub(super) async fn cancelling_a_queued_record_frees_it(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = queued(&store, request("default", "cancel-queued", BODY)).await;
    let note = entry("client", HistoryAction::Cancel, T0 + ms(50));
    let freed = match store.cancel(Cancel { id: record.id, entry: note.clone() }).await.unwrap() {
        Cancelled::Dequeued(record) => record,
        other => panic!("expected Dequeued, got {other:?}"),
    };
    assert_eq!(freed.phase(), Phase::Free);
    assert_eq!(freed.stop_reason, Some(StopReason::Cancelled));
    assert_eq!(freed.history, vec![note.clone()]);
    assert!(
        store
            .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE - ms(60), now: T0 + ms(60) })
            .await
            .unwrap()
            .is_none(),
        "nothing is left to run"
    );

    // Free, it has nothing left to cancel; neither has a done record or a missing one.
    assert!(
        matches!(store.cancel(Cancel { id: record.id, entry: note.clone() }).await.unwrap(), Cancelled::Refused(r) if r.id == record.id)
    );
    let finished = done(&store, request("default", "cancel-done", BODY), T0 + ms(100)).await;
    match store.cancel(Cancel { id: finished.id, entry: note.clone() }).await.unwrap() {
        Cancelled::Refused(r) => assert_eq!((r.phase(), r.history.len()), (Phase::Done, 0)),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(matches!(store.cancel(Cancel { id: RecordId::new(), entry: note }).await.unwrap(), Cancelled::Missing));
}

pub(super) async fn cancelling_an_in_progress_record_asks_its_worker_to_stop(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = in_progress(&store, request("default", "cancel-running", BODY)).await;
    assert_eq!(
        store
            .renew(Renew { id: record.id, holder: holder(&record, WORKER), lease: LEASE - ms(5), now: T0 + ms(5) })
            .await
            .unwrap(),
        LeaseStatus::Held { cancel_requested: false }
    );
    let note = entry("operator", HistoryAction::Cancel, T0 + ms(50));
    let flagged = match store.cancel(Cancel { id: record.id, entry: note.clone() }).await.unwrap() {
        Cancelled::Flagged(record) => record,
        other => panic!("expected Flagged, got {other:?}"),
    };
    assert_eq!(flagged.phase(), Phase::InProgress, "an attempt in flight finishes");
    assert!(flagged.cancel_requested);
    assert_eq!(flagged.history, vec![note]);
    assert_eq!(
        store
            .renew(Renew { id: record.id, holder: holder(&record, WORKER), lease: LEASE - ms(60), now: T0 + ms(60) })
            .await
            .unwrap(),
        LeaseStatus::Held { cancel_requested: true }
    );
    assert!(store.attempt_started(started(&record, 2, T0 + ms(70), T0 + LEASE)).await.unwrap().cancel_requested());
}

// ---- operators ----------------------------------------------------------------------------------

pub(super) async fn resolve_and_retry_apply_only_to_unknown_records_and_keep_history(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let waiting = queued(&store, request("default", "queued", BODY)).await;
    let note = entry("alice", HistoryAction::ResolveExecuted, T0 + ms(1_000));
    let untouched = refused(
        store
            .resolve(Resolve { id: waiting.id, resolution: Resolution::NotExecuted, entry: note.clone() })
            .await
            .unwrap(),
    );
    assert_eq!((untouched.phase(), untouched.history.len()), (Phase::Queued, 0));
    let untouched = refused(
        store.retry(Retry { id: waiting.id, deadline_at: T0 + ms(99_000), entry: note.clone() }).await.unwrap(),
    );
    assert_eq!((untouched.phase(), untouched.deadline_at), (Phase::Queued, T0 + ms(30_000)));
    assert!(matches!(
        store
            .resolve(Resolve { id: RecordId::new(), resolution: Resolution::NotExecuted, entry: note.clone() })
            .await
            .unwrap(),
        Action::Missing
    ));
    assert!(matches!(
        store.retry(Retry { id: RecordId::new(), deadline_at: T0, entry: note.clone() }).await.unwrap(),
        Action::Missing
    ));

    // Executed: done, with the operator's response replayed from now on.
    let executed = unknown(&store, request("default", "executed", BODY)).await;
    let answer = response(200, b"{\"confirmed\":true}");
    let resolved = applied(
        store
            .resolve(Resolve { id: executed.id, resolution: Resolution::Executed(answer.clone()), entry: note.clone() })
            .await
            .unwrap(),
    );
    assert_eq!(resolved.phase(), Phase::Done);
    assert_eq!(resolved.response, Some(answer));
    assert_eq!(resolved.history, vec![note.clone()]);
    assert_eq!((resolved.updated_at, resolved.probe_count), (T0 + ms(1_000), 0));
    assert_eq!(resolved.attempts.len(), 1, "the attempts are kept");
    refused(
        store
            .resolve(Resolve { id: executed.id, resolution: Resolution::NotExecuted, entry: note.clone() })
            .await
            .unwrap(),
    );
    refused(store.retry(Retry { id: executed.id, deadline_at: T0 + ms(99_000), entry: note.clone() }).await.unwrap());

    // Not executed: the key is free.
    let not_executed = unknown(&store, request("default", "not-executed", BODY)).await;
    let freed = applied(
        store
            .resolve(Resolve { id: not_executed.id, resolution: Resolution::NotExecuted, entry: note.clone() })
            .await
            .unwrap(),
    );
    assert_eq!((freed.phase(), freed.response.is_none()), (Phase::Free, true));
    assert_eq!(freed.history, vec![note.clone()]);

    // Retried: queued again with a fresh deadline, for a worker to claim.
    let retried = unknown(&store, request("default", "retried", BODY)).await;
    let again = entry("bob", HistoryAction::Retry, T0 + ms(2_000));
    let requeued = applied(
        store.retry(Retry { id: retried.id, deadline_at: T0 + ms(99_000), entry: again.clone() }).await.unwrap(),
    );
    assert_eq!(requeued.phase(), Phase::Queued);
    assert_eq!(
        (requeued.deadline_at, requeued.stop_reason, requeued.updated_at),
        (T0 + ms(99_000), None, T0 + ms(2_000))
    );
    assert_eq!(requeued.history, vec![again]);
    assert!(store
        .claim(ClaimQueued { id: retried.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(2_001) })
        .await
        .unwrap()
        .is_some());
}

pub(super) async fn each_attempt_keeps_the_policy_version_it_was_sent_under(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let (old, new) = ("aaaaaaaaaaaa", "bbbbbbbbbbbb");
    // Admitted claimed: the first attempt's mark carries the claim's version.
    let claim = Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH };
    let record = created(
        store
            .admit(Admit {
                new: NewRecord {
                    claim: Some(claim),
                    policy_version: Some(old.into()),
                    ..request("default", "versions", BODY)
                },
                retention_cutoff: Timestamp::EPOCH,
            })
            .await
            .unwrap(),
    );
    assert_eq!(record.policy_version.as_deref(), Some(old));
    assert_eq!(fetch(&store, record.id).await.policy_version.as_deref(), Some(old));
    let first = Attempt { policy_version: Some(old.into()), ..attempt(1, T0, "not_executed", Some(503)) };
    let then = AttemptEnd::Wait { not_before: T0 + ms(100) };
    assert!(store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: holder(&record, WORKER),
            attempt: Some(first),
            then,
            now: T0 + ms(50),
            stream: None
        })
        .await
        .unwrap()
        .is_held());

    // Attempt 2 is marked under another policy, and its worker dies before storing its outcome.
    assert!(store
        .attempt_started(AttemptStarted {
            id: record.id,
            holder: holder(&record, WORKER),
            number: 2,
            started_at: T0 + ms(100),
            lease: ms(100),
            reach: REACH,
            policy_version: new.into()
        })
        .await
        .unwrap()
        .is_held());
    let marked = fetch(&store, record.id).await;
    assert_eq!(marked.policy_version.as_deref(), Some(new), "the mark, written before the send, names its policy");
    assert_eq!(marked.attempts[0].policy_version.as_deref(), Some(old));

    // The take-over records the lost attempt under the policy of its mark.
    let lost = Attempt { policy_version: marked.policy_version.clone(), ..attempt(2, T0 + ms(100), "lost", None) };
    let to = TakeOverTo::Unknown(StopReason::UnsafeReplay);
    let taken = store.take_over(TakeOver {
        id: record.id,
        expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + ms(200) },
        claim: marked.claim,
        to,
        in_flight: Some(2),
        lost: Some(lost),
        entry: entry("node-b", HistoryAction::TakeOver(Phase::Unknown), T0 + ms(201)),
    });
    assert!(taken.await.unwrap());
    let settled = fetch(&store, record.id).await;
    let versions: Vec<Option<&str>> = settled.attempts.iter().map(|a| a.policy_version.as_deref()).collect();
    assert_eq!(versions, [Some(old), Some(new)]);
    let shown = settled.to_json(idem::record::View::Operator);
    assert_eq!(shown["attempts"][0]["policy_version"], old);
    assert_eq!(shown["attempts"][1]["policy_version"], new);
    assert_eq!(shown["policy_version"], new);
}

/// Sends attempt `number` of a record held by [`WORKER`] under `version`, answered `status` at `at`.
async fn sent(
    store: &Arc<dyn Store>,
    id: RecordId,
    number: u32,
    at: Timestamp,
    version: &str,
    status: u16,
    then: AttemptEnd,
) {
    let holder = holder(&fetch(store, id).await, WORKER);
    assert!(store
        .attempt_started(AttemptStarted {
            id,
            holder: holder.clone(),
            number,
            started_at: at,
            lease: LEASE,
            reach: REACH,
            policy_version: version.into()
        })
        .await
        .unwrap()
        .is_held());
    let outcome = if status < 300 { "success" } else { "not_executed" };
    let a = Attempt { policy_version: Some(version.into()), ..attempt(number, at, outcome, Some(status)) };
    assert!(store
        .attempt_ended(AttemptEnded {
            id,
            holder: holder.clone(),
            attempt: Some(a),
            then,
            now: at + ms(20),
            stream: None
        })
        .await
        .unwrap()
        .is_held());
}

pub(super) async fn a_canarys_sides_count_settled_executions_by_policy_version(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let (control, canary) = ("cccccccccccc", "dddddddddddd");
    let done = || AttemptEnd::Done(StopReason::Success, response(201, b"{}"));
    let retry = |at: Timestamp| AttemptEnd::Wait { not_before: at };

    // The canary: a 503 then a success, two attempts for one request.
    let salvaged = in_progress(&store, request("default", "salvaged", BODY)).await;
    sent(&store, salvaged.id, 1, T0 + ms(10), canary, 503, retry(T0 + ms(100))).await;
    sent(&store, salvaged.id, 2, T0 + ms(100), canary, 201, done()).await;

    // The control: a key freed after one 503, sent again by its client and then served: one
    // record, two executions.
    let freed = request("default", "freed", BODY);
    let first = in_progress(&store, freed.clone()).await;
    sent(&store, first.id, 1, T0 + ms(10), control, 503, AttemptEnd::Free(StopReason::AttemptCap)).await;
    let again = NewRecord { id: RecordId::new(), now: T0 + ms(500), ..freed };
    assert!(matches!(
        store.admit(Admit { new: again, retention_cutoff: Timestamp::EPOCH }).await.unwrap(),
        Admission::Requeued(_)
    ));
    assert!(store
        .claim(ClaimQueued { id: first.id, owner: WORKER.into(), lease: LEASE - ms(501), now: T0 + ms(501) })
        .await
        .unwrap()
        .is_some());
    sent(&store, first.id, 2, T0 + ms(510), control, 201, done()).await;

    // Not counted: still running, another route, or arrived before the window.
    let running = in_progress(&store, request("default", "running", BODY)).await;
    assert!(store
        .attempt_started(AttemptStarted {
            id: running.id,
            holder: holder(&running, WORKER),
            number: 1,
            started_at: T0 + ms(10),
            lease: LEASE - ms(10),
            reach: REACH,
            policy_version: control.into()
        })
        .await
        .unwrap()
        .is_held());
    let elsewhere = in_progress(&store, request_on("emails", "default", "elsewhere", BODY, T0)).await;
    sent(&store, elsewhere.id, 1, T0 + ms(10), control, 201, done()).await;
    let early = in_progress(&store, request_on("payments", "default", "early", BODY, T0 - ms(10_000))).await;
    sent(&store, early.id, 1, T0 + ms(10), canary, 503, AttemptEnd::Free(StopReason::AttemptCap)).await;

    let mut sides = store.sides(&"payments".into(), T0 - ms(1_000)).await.unwrap();
    sides.sort_by(|a, b| a.policy_version.cmp(&b.policy_version));
    let figures: Vec<(&str, u64, u64, u64)> = sides
        .iter()
        .map(|s| (s.policy_version.as_str(), s.requests.requests, s.requests.attempts, s.requests.succeeded))
        .collect();
    assert_eq!(figures, [(control, 2, 2, 1), (canary, 1, 2, 1)]);
}

/// How a streamed answer went is stored by the outcome's own write, only by the lease's holder;
/// an outcome without facts leaves them, and the next attempt clears them.
pub(super) async fn a_streamed_answers_facts_are_stored_with_its_outcome(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let facts = StreamFacts { bytes: 431, stored: true, cut_at: Some(431), first_byte_ms: 12, duration_ms: 950 };
    let record = in_progress(&store, request("default", "streamed", BODY)).await;
    let ended = |holder: Holder, then: AttemptEnd, stream: Option<StreamFacts>| AttemptEnded {
        id: record.id,
        holder,
        attempt: Some(attempt(1, T0 + ms(10), "success", Some(200))),
        then,
        now: T0 + ms(20),
        stream,
    };
    store.attempt_started(started(&record, 1, T0 + ms(10), T0 + ms(20_000))).await.unwrap();
    let waiting = AttemptEnd::Wait { not_before: T0 + ms(25) };
    let thief = ended(intruder(&record, "node-b/worker-9"), waiting.clone(), Some(facts.clone()));
    assert_eq!(store.attempt_ended(thief).await.unwrap(), LeaseStatus::Lost);
    assert_eq!(fetch(&store, record.id).await.stream, None, "nothing stored without the lease");

    let mine = ended(holder(&record, WORKER), waiting.clone(), Some(facts.clone()));
    assert!(matches!(store.attempt_ended(mine).await.unwrap(), LeaseStatus::Held { .. }));
    assert_eq!(fetch(&store, record.id).await.stream, Some(facts.clone()));
    store.attempt_ended(ended(holder(&record, WORKER), waiting, None)).await.unwrap();
    assert_eq!(fetch(&store, record.id).await.stream, Some(facts.clone()), "an outcome without facts keeps them");

    store.attempt_started(started(&record, 2, T0 + ms(30), T0 + ms(20_000))).await.unwrap();
    assert_eq!(fetch(&store, record.id).await.stream, None, "a new attempt clears them");

    let done = AttemptEnd::Done(StopReason::Success, response(200, b"data: [DONE]\n\n"));
    store.attempt_ended(ended(holder(&record, WORKER), done, Some(facts.clone()))).await.unwrap();
    let record = fetch(&store, record.id).await;
    assert_eq!(record.phase(), Phase::Done);
    assert_eq!(record.stream, Some(facts), "stored with the outcome");
}
