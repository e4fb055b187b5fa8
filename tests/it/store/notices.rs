//! What only PostgreSQL offers: other processes hear of the records a store settles and queues.

use super::*;

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

pub(super) async fn notices_announce_queued_and_settled_records_to_every_process(backend: Backend) {
    let (store, db) = store_on(backend).await;
    let url = db.url.clone();
    // Another process on the same database: it hears of changes made through `store`.
    let other = store::open(&url).await.unwrap();
    let mut here = store.notices().expect("PostgreSQL announces changes");
    let mut there = other.notices().expect("PostgreSQL announces changes");

    let record = queued(&store, request("default", "announced", BODY)).await;
    expect_notice(&mut here, Notice::Queued(record.id)).await;
    expect_notice(&mut there, Notice::Queued(record.id)).await;

    // A request waiting elsewhere asks to hear when it settles: that one is announced.
    other.watch(record.id).await.unwrap();
    let token = store
        .claim(ClaimQueued { id: record.id, owner: WORKER.into(), lease: LEASE - ms(1), now: T0 + ms(1) })
        .await
        .unwrap()
        .expect("claimed");
    let lease = store
        .attempt_ended(AttemptEnded {
            id: record.id,
            holder: Holder { owner: WORKER.into(), token },
            attempt: Some(attempt(1, T0 + ms(10), "success", Some(201))),
            then: AttemptEnd::Done(StopReason::Success, response(201, b"{}")),
            now: T0 + ms(20),
            stream: None,
        })
        .await
        .unwrap();
    assert!(lease.is_held());
    expect_notice(&mut there, Notice::Settled(record.id)).await;

    // A record nobody watches settles quietly: announcing every one would serialise commits.
    let mut audit = other.notices().expect("PostgreSQL announces changes");
    let quiet = in_progress(&store, request("default", "quiet", BODY)).await;
    let done = AttemptEnd::Done(StopReason::Success, response(201, b"{}"));
    store
        .attempt_ended(AttemptEnded {
            id: quiet.id,
            holder: holder(&quiet, WORKER),
            attempt: None,
            then: done,
            now: T0 + ms(20),
            stream: None,
        })
        .await
        .unwrap();

    // A queued record cancelled settles too, and an operator's retry queues again.
    let cancelled = queued(&store, request("default", "cancelled", BODY)).await;
    other.watch(cancelled.id).await.unwrap();
    assert!(matches!(
        store.cancel(Cancel { id: cancelled.id, entry: entry("client", HistoryAction::Cancel, T0) }).await.unwrap(),
        Cancelled::Dequeued(_)
    ));
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
    let unsure = AttemptEnd::Unknown(StopReason::UnsafeReplay);
    store
        .attempt_ended(AttemptEnded {
            id: retried.id,
            holder: holder(&retried, WORKER),
            attempt: Some(attempt(1, T0 + ms(10), "ambiguous", None)),
            then: unsure,
            now: T0 + ms(100),
            stream: None,
        })
        .await
        .unwrap();
    expect_notice(&mut there, Notice::Settled(retried.id)).await;
    applied(
        store
            .retry(Retry {
                id: retried.id,
                deadline_at: T0 + ms(60_000),
                entry: entry("operator", HistoryAction::Retry, T0 + ms(200)),
            })
            .await
            .unwrap(),
    );
    expect_notice(&mut there, Notice::Queued(retried.id)).await;
}
