//! Recording requests: one record per key under any concurrency, free records taken up again,
//! expired ones replaced.

use super::*;

pub(super) async fn an_admission_with_a_claim_is_recorded_in_progress_with_its_first_attempt_marked(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let claim = Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH };
    let new = NewRecord {
        claim: Some(claim.clone()),
        policy_version: Some(VERSION.into()),
        ..request("default", "express", BODY)
    };
    let record = created(store.admit(Admit { new: new.clone(), retention_cutoff: Timestamp::EPOCH }).await.unwrap());
    assert_eq!(record.phase(), Phase::InProgress);
    assert_eq!(record.lease, Some(idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE }));
    assert_eq!(record.in_flight, Some((1, T0)), "attempt 1 is marked as about to be sent");
    assert_same(&record, &fetch(&store, record.id).await);
    // The claim holds like any other: its worker may store the outcome, nobody else may.
    assert!(store
        .renew(Renew { id: record.id, holder: holder(&record, WORKER), lease: LEASE - ms(1), now: T0 + ms(2) })
        .await
        .unwrap()
        .is_held());
    assert_eq!(
        store
            .renew(Renew {
                id: record.id,
                holder: intruder(&record, "someone-else"),
                lease: LEASE - ms(2),
                now: T0 + ms(2)
            })
            .await
            .unwrap(),
        LeaseStatus::Lost
    );
    // A duplicate sees it in progress; it is not admitted twice.
    assert!(
        matches!(store.admit(Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap(), Admission::Existing(r) if r.id == record.id)
    );

    // A free record taken up again is queued, whatever the claim says: its worker claims it.
    let freed = request("default", "freed", BODY);
    let first = in_progress(&store, freed.clone()).await;
    store
        .attempt_ended(AttemptEnded {
            id: first.id,
            holder: holder(&first, WORKER),
            attempt: None,
            then: AttemptEnd::Free(StopReason::AttemptCap),
            now: T0 + ms(5),
            stream: None,
        })
        .await
        .unwrap();
    let again = NewRecord { id: RecordId::new(), claim: Some(claim), ..freed };
    match store.admit(Admit { new: again, retention_cutoff: Timestamp::EPOCH }).await.unwrap() {
        Admission::Requeued(r) => {
            assert_eq!(r.phase(), Phase::Queued);
            assert_eq!(r.in_flight, None);
            assert_eq!(r.lease, None);
        }
        other => panic!("expected a requeue, got {other:?}"),
    }
}

pub(super) async fn admit_creates_a_record_then_returns_it_for_the_same_key(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let new = request("default", "order-1", BODY);
    let record = created(store.admit(Admit { new: new.clone(), retention_cutoff: Timestamp::EPOCH }).await.unwrap());
    assert_eq!(record.id, new.id);
    assert_eq!((record.tenant.as_str(), record.key.as_str()), ("default", "order-1"));
    assert_eq!(
        (record.route.as_str(), record.method.as_str(), record.path.as_str(), record.query.as_str()),
        ("payments", "POST", "/payments", "currency=eur")
    );
    assert_eq!(record.fingerprint, new.fingerprint);
    assert_eq!(record.request, new.request);
    assert_eq!(record.phase(), Phase::Queued);
    assert_eq!((record.deadline_at, record.created_at, record.updated_at), (T0 + ms(30_000), T0, T0));
    assert!(record.lease.is_none() && record.in_flight.is_none() && record.response.is_none());
    assert!(record.attempts.is_empty() && record.history.is_empty() && !record.cancel_requested);
    assert_same(&record, &fetch(&store, new.id).await);

    let again = existing(
        store
            .admit(Admit { new: request("default", "order-1", BODY), retention_cutoff: Timestamp::EPOCH })
            .await
            .unwrap(),
    );
    assert_eq!(again.id, new.id);
    assert_eq!(again.phase(), Phase::Queued);

    assert_eq!(store.lookup(&"default".into(), &key("order-1")).await.unwrap().map(|r| r.id), Some(new.id));
    assert_eq!(fetch(&store, new.id).await.key, "order-1");
    assert!(store.lookup(&"default".into(), &key("order-2")).await.unwrap().is_none());
    assert!(store.get(RecordId::new()).await.unwrap().is_none());
    store.ping().await.unwrap();
}

pub(super) async fn of_64_concurrent_admits_of_one_key_exactly_one_creates_the_record(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let admits: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .admit(Admit { new: request("default", "contended", BODY), retention_cutoff: Timestamp::EPOCH })
                    .await
                    .unwrap()
            })
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
pub(super) async fn concurrent_admits_of_many_keys_create_each_once_and_answer_what_they_stored(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let old = done(&store, request("default", "expired", BODY), T0).await;
    let admits: Vec<_> = (0..128)
        .map(|i| {
            let store = store.clone();
            let key = if i == 127 { "expired".to_string() } else { format!("fresh-{}", i % 63) };
            let claim = (i % 2 == 0).then(|| Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH });
            let new = NewRecord { claim, policy_version: Some(VERSION.into()), ..request("default", &key, BODY) };
            tokio::spawn(async move { (key, store.admit(Admit { new, retention_cutoff: T0 + ms(1) }).await.unwrap()) })
        })
        .collect();
    let mut made: HashMap<String, Vec<Record>> = HashMap::new();
    let mut seen: HashMap<String, HashSet<RecordId>> = HashMap::new();
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
        let stored = store.lookup(&"default".into(), &super::key(key)).await.unwrap().unwrap();
        assert_eq!(seen[key], HashSet::from([stored.id]), "`{key}`: every admission saw the one record");
        if key != "expired" {
            assert_same(&records[0], &stored);
        }
    }
    let taken = store.lookup(&"default".into(), &key("expired")).await.unwrap().unwrap();
    assert_ne!(taken.id, old.id, "the expired record was replaced");
    assert_eq!(taken.state, State::NotStarted, "a record taken over is queued, not claimed");
}

pub(super) async fn two_tenants_with_one_key_have_independent_records(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let acme = queued(&store, request("acme", "shared-key", BODY)).await;
    let globex = created(
        store
            .admit(Admit { new: request("globex", "shared-key", b"{\"other\":1}"), retention_cutoff: Timestamp::EPOCH })
            .await
            .unwrap(),
    );
    assert_ne!(acme.id, globex.id);
    assert_eq!(store.lookup(&"acme".into(), &key("shared-key")).await.unwrap().unwrap().id, acme.id);
    assert_eq!(store.lookup(&"globex".into(), &key("shared-key")).await.unwrap().unwrap().id, globex.id);
    assert!(store.lookup(&"initech".into(), &key("shared-key")).await.unwrap().is_none());

    // Settling one tenant's record leaves the other's alone.
    assert!(store
        .claim(ClaimQueued { id: acme.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(1) })
        .await
        .unwrap()
        .is_some());
    assert_eq!(fetch(&store, globex.id).await.phase(), Phase::Queued);
}

pub(super) async fn a_free_record_is_requeued_by_the_same_request_and_kept_from_another(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let first = free(&store, request("default", "retry-me", BODY)).await;
    assert_eq!(first.stop_reason, Some(StopReason::Deadline));

    let other = existing(
        store
            .admit(Admit {
                new: request("default", "retry-me", b"{\"amount\":43}"),
                retention_cutoff: Timestamp::EPOCH,
            })
            .await
            .unwrap(),
    );
    assert_eq!(other.id, first.id);
    assert_eq!(other.phase(), Phase::Free, "another request must not take the key over");

    let mut again = request("default", "retry-me", BODY);
    again.now = T0 + ms(5_000);
    again.deadline_at = T0 + ms(35_000);
    let requeued = match store.admit(Admit { new: again, retention_cutoff: Timestamp::EPOCH }).await.unwrap() {
        Admission::Requeued(record) => record,
        other => panic!("expected Requeued, got {other:?}"),
    };
    assert_eq!(requeued.id, first.id, "a requeued record keeps its id");
    assert_eq!(requeued.phase(), Phase::Queued);
    assert_eq!((requeued.created_at, requeued.updated_at, requeued.deadline_at), (T0, T0 + ms(5_000), T0 + ms(35_000)));
    assert_eq!(requeued.stop_reason, None);
    let last = requeued.history.last().expect("the requeue is in the history");
    assert_eq!((&last.actor, last.action, last.at), (&Actor::Client(None), HistoryAction::Requeued, T0 + ms(5_000)));

    // Queued again, it is no longer free: a second identical request is a duplicate.
    assert_eq!(
        existing(
            store
                .admit(Admit { new: request("default", "retry-me", BODY), retention_cutoff: Timestamp::EPOCH })
                .await
                .unwrap()
        )
        .id,
        first.id
    );
}

pub(super) async fn a_done_record_past_retention_is_replaced_with_a_new_id(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let old = done(&store, request("default", "old", BODY), T0 + ms(1_000)).await;

    // Finished exactly at the cutoff: still retained, still replayed.
    let kept = existing(
        store.admit(Admit { new: request("default", "old", BODY), retention_cutoff: T0 + ms(1_000) }).await.unwrap(),
    );
    assert_eq!((kept.id, kept.phase()), (old.id, Phase::Done));

    let mut new = request("default", "old", b"{\"amount\":1}");
    new.now = T0 + ms(90_000);
    let replaced = created(store.admit(Admit { new: new.clone(), retention_cutoff: T0 + ms(1_001) }).await.unwrap());
    assert_eq!(replaced.id, new.id);
    assert_ne!(replaced.id, old.id);
    assert_eq!(replaced.phase(), Phase::Queued);
    assert_eq!(replaced.fingerprint, new.fingerprint);
    assert_eq!(replaced.created_at, T0 + ms(90_000));
    assert!(replaced.attempts.is_empty() && replaced.history.is_empty());
    assert!(replaced.response.is_none() && replaced.stop_reason.is_none() && replaced.lease.is_none());
    assert!(store.get(old.id).await.unwrap().is_none());

    // With a claim, the replacement is still queued (its worker claims it), and says so.
    let old = done(&store, request("default", "old-claimed", BODY), T0 + ms(1_000)).await;
    let claim = Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH };
    let new = NewRecord {
        claim: Some(claim),
        policy_version: Some(VERSION.into()),
        ..request("default", "old-claimed", BODY)
    };
    let replaced = created(store.admit(Admit { new: new.clone(), retention_cutoff: T0 + ms(1_001) }).await.unwrap());
    assert_eq!((replaced.id, replaced.phase(), replaced.in_flight), (new.id, Phase::Queued, None));
    assert_eq!(fetch(&store, new.id).await.phase(), Phase::Queued, "as stored");
    assert_ne!(replaced.id, old.id);
}
