//! Records by phase, as `/metrics` counts them and an operator lists them, read through the
//! partial index of each rare state rather than one index of every record by state
//! (docs/performance.md#fewer-b-trees-per-write).

use super::*;

/// Every record, listed a page at a time with no filter: what the counts must agree with.
async fn every_record(store: &Arc<dyn Store>) -> Vec<Record> {
    let mut filter = ListFilter { limit: 3, ..ListFilter::default() };
    let mut records = Vec::new();
    loop {
        let page = store.list(&filter).await.unwrap();
        records.extend(page.items);
        match page.next_cursor {
            Some(cursor) => filter.cursor = Some(cursor),
            None => return records,
        }
    }
}

/// The count by phase, every phase present, against the records as they stand.
async fn assert_counted(store: &Arc<dyn Store>, step: &str) {
    let mut truth: HashMap<&str, u64> =
        ["queued", "free", "in_progress", "done", "unknown"].into_iter().map(|p| (p, 0)).collect();
    for record in every_record(store).await {
        *truth.get_mut(record.phase().as_str()).unwrap() += 1;
    }
    let mut counted: HashMap<&str, u64> = HashMap::new();
    for (phase, n) in store.count_by_phase().await.unwrap() {
        *counted.entry(phase.as_str()).or_default() += n;
    }
    assert_eq!(counted, truth, "after {step}");
}

/// The count of each phase stays right through every change of state a record can go through:
/// in and out of each partial index counted, in and out of `done` (counted as what is left of
/// the table), a tombstone still done, a record deleted, one replaced under its key.
pub(super) async fn the_count_by_phase_follows_every_change_of_state(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    assert_counted(&store, "nothing").await;

    let waiting = queued(&store, request("default", "waiting", BODY)).await;
    let cancelled = queued(&store, request("default", "cancelled", BODY)).await;
    assert_counted(&store, "two admissions, queued").await;

    let claim = Claim { owner: WORKER.into(), marked_at: T0, lease: LEASE, reach: REACH };
    let claimed =
        NewRecord { claim: Some(claim), policy_version: Some(VERSION.into()), ..request("default", "claimed", BODY) };
    created(store.admit(Admit { new: claimed, retention_cutoff: Timestamp::EPOCH }).await.unwrap());
    assert_counted(&store, "an admission with a claim, in progress").await;

    assert!(store
        .claim(ClaimQueued { id: waiting.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(1) })
        .await
        .unwrap()
        .is_some());
    assert_counted(&store, "a claim, queued to in progress").await;

    let note = entry("alice", HistoryAction::Cancel, T0 + ms(5));
    assert!(matches!(store.cancel(Cancel { id: cancelled.id, entry: note }).await.unwrap(), Cancelled::Dequeued(_)));
    assert_counted(&store, "a cancel, queued to free").await;

    done(&store, request("default", "finished", BODY), T0 + ms(1_000)).await;
    done(&store, request("default", "kept", BODY), T0 + ms(5_000)).await;
    assert_counted(&store, "two outcomes, in progress to done").await;

    let released = free(&store, request("default", "released", BODY)).await;
    assert_counted(&store, "an outcome, in progress to free").await;
    assert!(matches!(
        store.admit(Admit { new: request("default", "released", BODY), retention_cutoff: Timestamp::EPOCH }).await.unwrap(),
        Admission::Requeued(r) if r.id == released.id
    ));
    assert_counted(&store, "the same request again, free to queued").await;

    let executed = unknown(&store, request("default", "executed", BODY)).await;
    let retried = unknown(&store, request("default", "retried", BODY)).await;
    let not_executed = unknown(&store, request("default", "not-executed", BODY)).await;
    assert_counted(&store, "three outcomes, in progress to unknown").await;
    let note = entry("alice", HistoryAction::ResolveExecuted, T0 + ms(1_000));
    let answer = response(200, b"{}");
    let resolve = Resolve { id: executed.id, resolution: Resolution::Executed(answer), entry: note.clone() };
    applied(store.resolve(resolve).await.unwrap());
    assert_counted(&store, "a resolve, unknown to done").await;
    let resolve = Resolve { id: not_executed.id, resolution: Resolution::NotExecuted, entry: note.clone() };
    applied(store.resolve(resolve).await.unwrap());
    assert_counted(&store, "a resolve, unknown to free").await;
    applied(store.retry(Retry { id: retried.id, deadline_at: T0 + ms(99_000), entry: note }).await.unwrap());
    assert_counted(&store, "a retry, unknown to queued").await;

    // Retention: `finished` becomes a tombstone (still done), then is deleted; `kept`, past its
    // retention too, is replaced under its key by a new request, queued.
    let payments = RouteSweep { route: "payments".into(), cutoff: T0 + ms(2_000), tombstone_after: Some(ms(1_000)) };
    let plan = SweepPlan { now: T0 + ms(2_000), routes: vec![payments], others_cutoff: T0 + ms(2_000) };
    assert!(store.sweep_done(Sweep { plan, limit: 100 }).await.unwrap() >= 1);
    assert_counted(&store, "a sweep, done to a tombstone").await;
    let plan = SweepPlan { now: T0 + ms(10_000), routes: vec![], others_cutoff: Timestamp::EPOCH };
    assert!(store.sweep_done(Sweep { plan, limit: 100 }).await.unwrap() >= 1);
    assert_counted(&store, "a sweep, a tombstone deleted").await;
    let mut again = request("default", "kept", b"{\"amount\":1}");
    again.now = T0 + ms(90_000);
    created(store.admit(Admit { new: again, retention_cutoff: T0 + ms(6_000) }).await.unwrap());
    assert_counted(&store, "a done record past retention replaced, queued").await;
}

/// Each state is listed oldest first, ties by id, every record exactly once a page at a time,
/// from the index that holds it: queued and free records (two indexes) merged into one order,
/// in-progress records sorted, unknown and done records walked; with the route and tenant
/// filters on the way.
pub(super) async fn each_state_is_listed_in_order_from_its_own_index(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let mut ids = Vec::new();
    for i in 0..30u64 {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let route = if i % 3 == 0 { "refunds" } else { "payments" };
        // Three records share each creation time, so that ties between the two indexes of
        // `not_started` fall within a page and across pages.
        let new = request_on(route, tenant, &format!("k{i}"), BODY, T0 + ms(i / 3));
        let record = match i % 5 {
            0 => queued(&store, new).await,
            1 => free(&store, new).await,
            2 => in_progress(&store, new).await,
            3 => unknown(&store, new).await,
            _ => done(&store, new, T0 + ms(1_000)).await,
        };
        ids.push(record.id);
    }
    let mut all = Vec::new();
    for id in ids {
        all.push(fetch(&store, id).await);
    }
    all.sort_by_key(|r| (r.created_at, r.id));
    assert_eq!(
        every_record(&store).await.iter().map(|r| r.id).collect::<Vec<_>>(),
        all.iter().map(|r| r.id).collect::<Vec<_>>()
    );

    for state in [State::NotStarted, State::InProgress, State::Unknown, State::Done] {
        for (route, tenant) in
            [(None, None), (Some("payments"), None), (None, Some("globex")), (Some("refunds"), Some("acme"))]
        {
            let wanted: Vec<RecordId> = all
                .iter()
                .filter(|r| r.state == state)
                .filter(|r| route.is_none_or(|route| r.route == route))
                .filter(|r| tenant.is_none_or(|tenant| r.tenant == tenant))
                .map(|r| r.id)
                .collect();
            assert!(!wanted.is_empty(), "{state:?} {route:?} {tenant:?}");
            for limit in [1, 2, 4, 50] {
                let mut filter = ListFilter {
                    state: Some(state),
                    route: route.map(Into::into),
                    tenant: tenant.map(Into::into),
                    limit,
                    cursor: None,
                };
                let mut listed = Vec::new();
                loop {
                    let page = store.list(&filter).await.unwrap();
                    assert!(page.items.len() <= limit as usize);
                    listed.extend(page.items.iter().map(|r| r.id));
                    match page.next_cursor {
                        Some(cursor) => filter.cursor = Some(Cursor::decode(&cursor.encode()).unwrap()),
                        None => break,
                    }
                }
                assert_eq!(listed, wanted, "{state:?} route {route:?} tenant {tenant:?}, {limit} a page");
            }
        }
    }
    // The queued and free halves of `not_started` both in it.
    let not_started: Vec<Phase> = all.iter().filter(|r| r.state == State::NotStarted).map(|r| r.phase()).collect();
    assert!(not_started.contains(&Phase::Queued) && not_started.contains(&Phase::Free));
}
