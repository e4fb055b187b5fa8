//! Take-over of expired leases, orphaned queued records, probes, listings, counts and the
//! retention sweep.

use super::*;

pub(super) async fn take_over_is_a_compare_and_set_on_the_expired_lease(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = in_progress(&store, request("default", "orphan", BODY)).await;
    let until = T0 + ms(20_000);
    assert!(store.attempt_started(started(&record, 1, T0 + ms(10), until)).await.unwrap().is_held());
    assert!(store.expired_leases(until, 10).await.unwrap().is_empty(), "not expired while `until` is now");
    let expired = store.expired_leases(until + ms(1), 10).await.unwrap();
    assert_eq!(expired.iter().map(|r| r.id).collect::<Vec<_>>(), vec![record.id]);

    let lost = attempt(1, T0 + ms(10), "lost", None);
    let note = entry("node-b", HistoryAction::TakeOver(Phase::Unknown), until + ms(1));
    let stale = store.take_over(TakeOver {
        id: record.id,
        expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE },
        claim: record.claim,
        to: TakeOverTo::Unknown(StopReason::UnsafeReplay),
        in_flight: Some(1),
        lost: Some(lost.clone()),
        entry: note.clone(),
    });
    assert!(!stale.await.unwrap(), "the lease seen must be the current one");
    let other_claim = store.take_over(TakeOver {
        id: record.id,
        expired: idem::record::Lease { owner: WORKER.into(), expires_at: until },
        claim: ClaimToken(record.claim.0 - 1),
        to: TakeOverTo::Unknown(StopReason::UnsafeReplay),
        in_flight: Some(1),
        lost: Some(lost.clone()),
        entry: note.clone(),
    });
    assert!(!other_claim.await.unwrap(), "the claim seen must be the current one");
    assert!(store
        .take_over(TakeOver {
            id: record.id,
            expired: idem::record::Lease { owner: WORKER.into(), expires_at: until },
            claim: record.claim,
            to: TakeOverTo::Unknown(StopReason::UnsafeReplay),
            in_flight: Some(1),
            lost: Some(lost.clone()),
            entry: note.clone()
        })
        .await
        .unwrap());
    assert!(
        !store
            .take_over(TakeOver {
                id: record.id,
                expired: idem::record::Lease { owner: WORKER.into(), expires_at: until },
                claim: record.claim,
                to: TakeOverTo::Queued,
                in_flight: Some(1),
                lost: None,
                entry: note.clone()
            })
            .await
            .unwrap(),
        "of two sweepers with the same view, one wins"
    );

    let taken = fetch(&store, record.id).await;
    assert_eq!(taken.phase(), Phase::Unknown);
    assert_eq!(taken.stop_reason, Some(StopReason::UnsafeReplay));
    assert_eq!((taken.lease, taken.in_flight), (None, None));
    assert_eq!(taken.attempts, vec![lost]);
    assert_eq!(taken.history, vec![note.clone()]);
    assert!(store.expired_leases(until + ms(1), 10).await.unwrap().is_empty());

    // A record with nothing in flight is queued again for any worker.
    let idle = in_progress(&store, request("default", "idle", BODY)).await;
    assert!(store
        .take_over(TakeOver {
            id: idle.id,
            expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE },
            claim: idle.claim,
            to: TakeOverTo::Queued,
            in_flight: None,
            lost: None,
            entry: note.clone()
        })
        .await
        .unwrap());
    let requeued = fetch(&store, idle.id).await;
    assert_eq!((requeued.phase(), requeued.attempts.len(), requeued.stop_reason), (Phase::Queued, 0, None));
    assert!(store
        .claim(ClaimQueued { id: idle.id, owner: "node-b".into(), lease: LEASE - ms(2), now: until + ms(2) })
        .await
        .unwrap()
        .is_some());

    // Past its deadline, it is freed instead.
    let late = in_progress(&store, request("default", "late", BODY)).await;
    assert!(store
        .take_over(TakeOver {
            id: late.id,
            expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE },
            claim: late.claim,
            to: TakeOverTo::Free(StopReason::Deadline),
            in_flight: None,
            lost: None,
            entry: note
        })
        .await
        .unwrap());
    let freed = fetch(&store, late.id).await;
    assert_eq!((freed.phase(), freed.stop_reason), (Phase::Free, Some(StopReason::Deadline)));
}

/// A mark that lands between a sweep's read and its write, in the very millisecond of the lease
/// the sweep read (its holder's clock a little behind the sweeper's), makes the sweep's decision
/// stale: the take-over is refused, and the mark stands. Taken, it would have queued the record
/// with its attempt on the way, for a second worker to send again.
pub(super) async fn a_mark_landing_between_a_sweeps_read_and_its_write_refuses_the_take_over(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = in_progress(&store, request("default", "raced", BODY)).await;
    let seen = store.expired_leases(T0 + LEASE + ms(1), 10).await.unwrap().remove(0);
    assert_eq!((seen.id, seen.in_flight), (record.id, None), "read with nothing in flight: it would be queued");
    let lease = seen.lease.clone().expect("claimed");

    assert!(store.attempt_started(started(&seen, 1, T0 + ms(1), T0 + LEASE)).await.unwrap().is_held());
    let marked = fetch(&store, record.id).await;
    assert_eq!(marked.lease.as_ref(), Some(&lease), "the mark's lease ends in the very millisecond read");

    let take_over = TakeOver {
        id: seen.id,
        expired: lease,
        claim: seen.claim,
        in_flight: None,
        to: TakeOverTo::Queued,
        lost: None,
        entry: entry("node:node-b", HistoryAction::TakeOver(Phase::Queued), T0 + LEASE + ms(2)),
    };
    assert!(!store.take_over(take_over).await.unwrap(), "decided on a record that has changed since");
    let after = fetch(&store, record.id).await;
    assert_eq!((after.phase(), after.in_flight.map(|(n, _)| n)), (Phase::InProgress, Some(1)), "the mark stands");
}

/// The same record's worker dies again and again while an attempt is in flight, on a replay-safe
/// route (its attempts marked with the route's policy): each take-over continues it, and is
/// counted, until the one past the cap stops it.
pub(super) async fn a_record_whose_worker_keeps_dying_is_stopped_at_the_take_over_cap(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    const MAX_TAKEOVERS: u32 = 2;
    let config = "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"http://127.0.0.1:9\"\nreplay_safe = true\n";
    let route = idem::config::Config::parse_with_env(config, |_| None).unwrap().routes.remove(0);
    let record = queued(&store, request("default", "poison", BODY)).await;
    let mut notes = Vec::new();
    for round in 0..=MAX_TAKEOVERS {
        let (now, worker) = (T0 + ms(1_000 * (round as u64 + 1)), format!("node-{round}"));
        let until = now + ms(500);
        let token = store
            .claim(ClaimQueued { id: record.id, owner: worker.as_str().into(), lease: until - now, now })
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}"));
        assert_eq!(token, ClaimToken(i64::from(round) + 1), "each claim a new token");
        assert!(store
            .attempt_started(AttemptStarted {
                id: record.id,
                holder: Holder { owner: worker.as_str().into(), token },
                number: round + 1,
                started_at: now + ms(1),
                lease: until - (now + ms(1)),
                reach: REACH,
                policy_version: route.policy_version.clone()
            })
            .await
            .unwrap()
            .is_held());
        // The worker dies with its attempt in flight; its lease runs out.
        let expired = store.expired_leases(until + ms(1), 10).await.unwrap();
        let seen = expired.iter().find(|r| r.id == record.id).expect("its lease expired");
        assert_eq!(seen.takeovers, round);
        let to = idem::test_support::upkeep::after_lease_expiry(seen, Some(&route), until + ms(1), MAX_TAKEOVERS);
        let note = entry(&format!("node-{}", round + 1), HistoryAction::TakeOver(Phase::Unknown), until + ms(1));
        let lost = attempt(round + 1, now + ms(1), "lost", None);
        assert!(store
            .take_over(TakeOver {
                id: record.id,
                expired: idem::record::Lease { owner: worker.as_str().into(), expires_at: until },
                claim: token,
                to,
                in_flight: Some(round + 1),
                lost: Some(lost),
                entry: note.clone()
            })
            .await
            .unwrap());
        notes.push(note);
        let after = fetch(&store, record.id).await;
        assert_eq!(after.takeovers, round + 1);
        if round < MAX_TAKEOVERS {
            assert_eq!((to, after.phase(), after.stop_reason), (TakeOverTo::Queued, Phase::Queued, None));
        }
    }
    let stopped = fetch(&store, record.id).await;
    assert_eq!(stopped.phase(), Phase::Unknown, "attempts may have run: {stopped:?}");
    assert_eq!(stopped.stop_reason, Some(StopReason::TakeoverCap));
    assert_eq!((stopped.lease, stopped.in_flight), (None, None));
    assert_eq!(stopped.attempts.iter().map(|a| a.outcome.as_str()).collect::<Vec<_>>(), ["lost"; 3]);
    assert_eq!(stopped.history, notes);
    assert!(store.expired_leases(T0 + ms(60_000), 10).await.unwrap().is_empty(), "nothing left to take over");
    assert!(
        store
            .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: ms(50_000), now: T0 + ms(10_000) })
            .await
            .unwrap()
            .is_none(),
        "nor to claim"
    );
}

/// A freed record that its client sends again keeps its count (a record that crashes its
/// workers would otherwise start over with every resend); a new operation on the key, and a
/// record an operator re-drives, start from zero.
pub(super) async fn the_take_over_count_survives_a_requeue_and_starts_afresh_for_a_new_operation_or_an_operator_retry(
    backend: Backend,
) {
    let (store, _db) = store_on(backend).await;
    let note = entry("node-b", HistoryAction::TakeOver(Phase::Unknown), T0 + LEASE + ms(1));
    let take_over = |record: &Record, to| {
        store.take_over(TakeOver {
            id: record.id,
            expired: idem::record::Lease { owner: WORKER.into(), expires_at: T0 + LEASE },
            claim: record.claim,
            to,
            in_flight: None,
            lost: None,
            entry: note.clone(),
        })
    };

    let new = request("default", "freed", BODY);
    let freed = in_progress(&store, new.clone()).await;
    assert!(take_over(&freed, TakeOverTo::Free(StopReason::TakeoverCap)).await.unwrap());
    let freed = fetch(&store, freed.id).await;
    assert_eq!((freed.phase(), freed.stop_reason, freed.takeovers), (Phase::Free, Some(StopReason::TakeoverCap), 1));
    match store
        .admit(Admit { new: NewRecord { id: RecordId::new(), ..new }, retention_cutoff: Timestamp::EPOCH })
        .await
        .unwrap()
    {
        Admission::Requeued(r) => assert_eq!((r.phase(), r.takeovers, r.stop_reason), (Phase::Queued, 1, None)),
        other => panic!("expected Requeued, got {other:?}"),
    }

    let stuck = in_progress(&store, request("default", "stuck", BODY)).await;
    assert!(take_over(&stuck, TakeOverTo::Unknown(StopReason::TakeoverCap)).await.unwrap());
    let retried = applied(
        store
            .retry(Retry {
                id: stuck.id,
                deadline_at: T0 + ms(90_000),
                entry: entry("ops", HistoryAction::Retry, T0 + LEASE + ms(2)),
            })
            .await
            .unwrap(),
    );
    assert_eq!((retried.phase(), retried.takeovers), (Phase::Queued, 0));

    let new = request("default", "finished", BODY);
    let finished = in_progress(&store, new.clone()).await;
    assert!(take_over(&finished, TakeOverTo::Queued).await.unwrap());
    let token = store
        .claim(ClaimQueued { id: finished.id, owner: WORKER.into(), lease: LEASE - ms(2), now: T0 + LEASE + ms(2) })
        .await
        .unwrap()
        .expect("queued again, claimed again");
    let done = AttemptEnd::Done(StopReason::Success, response(201, b"{}"));
    assert!(store
        .attempt_ended(AttemptEnded {
            id: finished.id,
            holder: Holder { owner: WORKER.into(), token },
            attempt: None,
            then: done,
            now: T0 + LEASE + ms(3),
            stream: None
        })
        .await
        .unwrap()
        .is_held());
    assert_eq!(fetch(&store, finished.id).await.takeovers, 1);
    let again = NewRecord { id: RecordId::new(), now: T0 + ms(100_000), ..new };
    let replaced = created(store.admit(Admit { new: again, retention_cutoff: T0 + ms(50_000) }).await.unwrap());
    assert_eq!(fetch(&store, replaced.id).await.takeovers, 0, "past retention, a new operation");
}

pub(super) async fn two_concurrent_callers_claim_each_unclaimed_record_once(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let mut ids = HashSet::new();
    for i in 0..24 {
        let new = request_on("payments", "default", &format!("orphan-{i}"), BODY, T0 + ms(i));
        ids.insert(queued(&store, new).await.id);
    }
    // Queued after `idle_since`: its node may still claim it, so nobody else does.
    let fresh = queued(&store, request_on("payments", "default", "fresh", BODY, T0 + ms(5_000))).await;

    let callers: Vec<_> = ["node-a", "node-b"]
        .into_iter()
        .map(|owner| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut claimed = Vec::new();
                loop {
                    let batch = store
                        .claim_unclaimed(ClaimUnclaimed {
                            owner: owner.into(),
                            lease: ms(54_000),
                            idle_since: T0 + ms(1_000),
                            now: T0 + ms(6_000),
                            limit: 3,
                        })
                        .await
                        .unwrap();
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
    assert!(store
        .claim_unclaimed(ClaimUnclaimed {
            owner: "node-c".into(),
            lease: ms(53_000),
            idle_since: T0 + ms(1_000),
            now: T0 + ms(7_000),
            limit: 10
        })
        .await
        .unwrap()
        .is_empty());
}

pub(super) async fn probes_are_due_after_settle_and_then_at_the_next_probe_time(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let record = unknown(&store, request("default", "probe-me", BODY)).await;
    let became_unknown = record.updated_at;
    let settle = ms(5_000);
    let due = |now: Timestamp| {
        let store = store.clone();
        async move {
            store
                .probes_due(ProbesDue { route: "payments".into(), settle, now, limit: 10 })
                .await
                .unwrap()
                .iter()
                .map(|r| r.id)
                .collect::<Vec<_>>()
        }
    };
    assert!(due(became_unknown + settle - ms(1)).await.is_empty(), "not before settle");
    assert_eq!(due(became_unknown + settle).await, vec![record.id]);
    assert!(store
        .probes_due(ProbesDue { route: "refunds".into(), settle, now: became_unknown + settle, limit: 10 })
        .await
        .unwrap()
        .is_empty());

    let next = became_unknown + ms(20_000);
    let asked = entry("probe", HistoryAction::Probe, became_unknown + settle);
    let probed = applied(
        store
            .probed(Probed {
                id: record.id,
                claim: record.claim,
                resolution: None,
                asked_at: asked.at,
                next_probe_at: next,
                entry: asked.clone(),
            })
            .await
            .unwrap(),
    );
    assert_eq!((probed.phase(), probed.probe_count, probed.next_probe_at), (Phase::Unknown, 1, Some(next)));
    assert_eq!(probed.history, vec![asked.clone()]);
    assert!(due(next - ms(1)).await.is_empty(), "the next probe waits for its time");
    assert_eq!(due(next).await, vec![record.id]);

    let answered = entry("probe", HistoryAction::Probe, next);
    let settled = applied(
        store
            .probed(Probed {
                id: record.id,
                claim: record.claim,
                resolution: Some(Resolution::Executed(response(200, b"{}"))),
                asked_at: answered.at,
                next_probe_at: next + ms(1),
                entry: answered.clone(),
            })
            .await
            .unwrap(),
    );
    assert_eq!((settled.phase(), settled.probe_count, settled.next_probe_at), (Phase::Done, 2, None));
    assert_eq!(settled.history, vec![asked, answered.clone()]);
    assert!(due(next + ms(60_000)).await.is_empty());
    refused(
        store
            .probed(Probed {
                id: record.id,
                claim: record.claim,
                resolution: None,
                asked_at: answered.at,
                next_probe_at: next + ms(1),
                entry: answered.clone(),
            })
            .await
            .unwrap(),
    );
    assert!(matches!(
        store
            .probed(Probed {
                id: RecordId::new(),
                claim: record.claim,
                resolution: None,
                asked_at: answered.at,
                next_probe_at: next,
                entry: answered,
            })
            .await
            .unwrap(),
        Action::Missing
    ));
}

pub(super) async fn listing_filters_and_pages_through_every_record_exactly_once(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let mut all = Vec::new();
    for i in 0..17i64 {
        let tenant = if i % 2 == 0 { "acme" } else { "globex" };
        let route = if i % 3 == 0 { "refunds" } else { "payments" };
        // Three records share each creation time: the id breaks the tie.
        let record = queued(&store, request_on(route, tenant, &format!("k{i}"), BODY, T0 + ms(i as u64 / 3))).await;
        if i % 4 == 0 {
            assert!(store
                .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE - ms(100), now: T0 + ms(100) })
                .await
                .unwrap()
                .is_some());
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

pub(super) async fn records_are_counted_by_phase(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    assert!(store.count_by_phase().await.unwrap().iter().all(|(_, n)| *n == 0));
    for i in 0..3 {
        queued(&store, request("default", &format!("queued-{i}"), BODY)).await;
    }
    for i in 0..2 {
        in_progress(&store, request("default", &format!("running-{i}"), BODY)).await;
    }
    done(&store, request("default", "done", BODY), T0 + ms(100)).await;
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

/// Deletes `payments` records (no tombstones) and those of unconfigured routes done before `cutoff`.
fn deleting(cutoff: Timestamp) -> SweepPlan {
    let payments = RouteSweep { route: "payments".into(), cutoff, tombstone_after: None };
    SweepPlan { now: cutoff, routes: vec![payments], others_cutoff: cutoff }
}

pub(super) async fn sweeping_deletes_only_done_records_finished_before_the_cutoff(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let old_a = done(&store, request("default", "old-a", BODY), T0 + ms(1_000)).await;
    let old_b = done(&store, request("default", "old-b", BODY), T0 + ms(1_100)).await;
    let recent = done(&store, request("default", "recent", BODY), T0 + ms(3_000)).await;
    let unsettled = unknown(&store, request("default", "unknown", BODY)).await;
    let waiting = queued(&store, request("default", "queued", BODY)).await;
    let released = free(&store, request("default", "free", BODY)).await;

    let cutoff = T0 + ms(2_000);
    assert_eq!(
        store.sweep_done(Sweep { plan: deleting(cutoff), limit: 1 }).await.unwrap(),
        1,
        "at most `limit` per call"
    );
    assert_eq!(store.sweep_done(Sweep { plan: deleting(cutoff), limit: 1 }).await.unwrap(), 1);
    assert_eq!(store.sweep_done(Sweep { plan: deleting(cutoff), limit: 1 }).await.unwrap(), 0);
    for gone in [old_a.id, old_b.id] {
        assert!(store.get(gone).await.unwrap().is_none());
    }
    for kept in [recent.id, unsettled.id, waiting.id, released.id] {
        fetch(&store, kept).await;
    }
    assert_eq!(
        store.sweep_done(Sweep { plan: deleting(T0 + ms(3_000)), limit: 100 }).await.unwrap(),
        0,
        "finished at the cutoff is kept"
    );
    assert_eq!(store.sweep_done(Sweep { plan: deleting(T0 + ms(3_001)), limit: 100 }).await.unwrap(), 1);
    assert!(store.get(recent.id).await.unwrap().is_none());
}

pub(super) async fn past_retention_a_done_record_becomes_a_tombstone_that_refuses_its_own_request(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    let old = done(&store, request("default", "spent", BODY), T0 + ms(1_000)).await;
    let other_route = done(&store, request_on("gone", "default", "elsewhere", BODY, T0), T0 + ms(1_000)).await;
    // Retention ends at T0 + 2 s; the tombstone lasts 10 s more.
    let payments = RouteSweep { route: "payments".into(), cutoff: T0 + ms(2_000), tombstone_after: Some(ms(11_000)) };
    let plan = SweepPlan { now: T0 + ms(2_000), routes: vec![payments], others_cutoff: T0 + ms(2_000) };
    assert_eq!(store.sweep_done(Sweep { plan: plan.clone(), limit: 100 }).await.unwrap(), 2);
    assert!(store.get(other_route.id).await.unwrap().is_none(), "a route no longer configured keeps no tombstone");

    let tombstone = fetch(&store, old.id).await;
    assert_eq!(tombstone.tombstone_until, Some(T0 + ms(12_000)));
    assert_eq!(tombstone.state, State::Done);
    assert_eq!(tombstone.fingerprint, old.fingerprint);
    assert_eq!(tombstone.response.as_ref().map(|r| r.status), Some(201), "the final status is kept");
    assert!(tombstone.response.unwrap().body.is_empty() && tombstone.request.body.is_empty(), "bodies dropped");
    assert!(tombstone.attempts.is_empty() && tombstone.history.is_empty());
    // Sweeping again changes nothing: a tombstone is not swept as a done record.
    assert_eq!(store.sweep_done(Sweep { plan, limit: 100 }).await.unwrap(), 0);

    // The same request within the tombstone: refused with the tombstone, never admitted.
    let within = T0 + ms(5_000);
    let again = NewRecord {
        id: RecordId::new(),
        now: within,
        tombstone_cutoff: Some(within - ms(11_000)),
        ..request("default", "spent", BODY)
    };
    match store.admit(Admit { new: again.clone(), retention_cutoff: within - ms(2_000) }).await.unwrap() {
        Admission::Existing(record) => assert_eq!(record.id, old.id),
        other => panic!("a spent key was admitted again: {other:?}"),
    }
    // A route that keeps no tombstones (any more) lets it execute again.
    let untombed = NewRecord { tombstone_cutoff: None, ..again.clone() };
    match store.admit(Admit { new: untombed, retention_cutoff: within - ms(2_000) }).await.unwrap() {
        Admission::Requeued(record) | Admission::Created(record) => assert_eq!(record.tombstone_until, None),
        other => panic!("{other:?}"),
    }
}

pub(super) async fn another_request_under_a_spent_key_and_a_late_one_execute(backend: Backend) {
    let (store, _db) = store_on(backend).await;
    done(&store, request("default", "reused", BODY), T0 + ms(1_000)).await;
    done(&store, request("default", "late", BODY), T0 + ms(1_000)).await;
    let payments = RouteSweep { route: "payments".into(), cutoff: T0 + ms(2_000), tombstone_after: Some(ms(11_000)) };
    store
        .sweep_done(Sweep {
            plan: SweepPlan { now: T0 + ms(2_000), routes: vec![payments], others_cutoff: Timestamp::EPOCH },
            limit: 100,
        })
        .await
        .unwrap();

    let within = T0 + ms(5_000);
    let other_body = NewRecord {
        id: RecordId::new(),
        now: within,
        tombstone_cutoff: Some(within - ms(11_000)),
        ..request("default", "reused", b"{\"amount\":7}")
    };
    assert!(matches!(
        store.admit(Admit { new: other_body, retention_cutoff: within - ms(2_000) }).await.unwrap(),
        Admission::Requeued(_) | Admission::Created(_)
    ));
    // Past the tombstone: the same request executes afresh, before the sweep deletes it and after.
    let after = T0 + ms(13_000);
    let late = NewRecord {
        id: RecordId::new(),
        now: after,
        tombstone_cutoff: Some(after - ms(11_000)),
        ..request("default", "late", BODY)
    };
    assert!(matches!(
        store.admit(Admit { new: late, retention_cutoff: after - ms(2_000) }).await.unwrap(),
        Admission::Requeued(_) | Admission::Created(_)
    ));
}
