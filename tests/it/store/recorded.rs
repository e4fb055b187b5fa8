//! The read behind `idem simulate --history` (`store::recorded::Reader`), on both backends: a
//! route's requests since a time, oldest first, with their attempts, read through a read-only
//! connection opened beside a live store.

use crate::common::backend::{postgres_url_for_new_db, skipped};
use crate::common::{Backend, Db};
use bytes::Bytes;
use idem::domain::fingerprint::Fingerprint;
use idem::domain::StopReason;
use idem::domain::{AttemptOutcome, ClaimToken, Holder, RecordId, State, Timestamp};
use idem::record::{Attempt, StoredRequest, StoredResponse};
use idem::store::recorded::Reader;
use idem::store::{Admit, AttemptEnd, AttemptEnded, AttemptStarted, Claim, NewRecord, Store};

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

/// A span of `n` milliseconds, to move time on from [`T0`].
const fn ms(n: u64) -> std::time::Duration {
    std::time::Duration::from_millis(n)
}
const WORKER: &str = "node-a/worker-1";

fn request(route: &str, key: &str, now: Timestamp, claimed: bool) -> NewRecord {
    let path = format!("/{route}");
    NewRecord {
        id: RecordId::new(),
        tenant: "default".into(),
        key: idem::domain::key::IdempotencyKey::parse(key).unwrap(),
        route: route.into(),
        method: http::Method::POST,
        path: path.clone(),
        query: String::new(),
        fingerprint: Fingerprint::of(route, "POST", &path, "", None, b"{}"),
        request: StoredRequest { headers: vec![], body: Bytes::from_static(b"{}") },
        deadline_at: now + ms(30_000),
        now,
        policy_version: Some(VERSION.into()),
        claim: claimed.then(|| Claim { owner: WORKER.into(), marked_at: now, lease: ms(15_000), reach: ms(12_000) }),
        tombstone_cutoff: None,
    }
}

/// The policy every attempt here was sent under.
const VERSION: &str = "0123456789ab";

fn attempt(number: u32, started_at: Timestamp, status: u16, retry_after_ms: Option<u64>) -> Attempt {
    Attempt {
        number,
        started_at,
        duration_ms: 20,
        outcome: if status == 200 { AttemptOutcome::Success } else { AttemptOutcome::NotExecuted },
        status: Some(status),
        error: None,
        wait_ms: if number == 1 { 0 } else { 100 },
        retry_after_ms,
        policy_version: Some(VERSION.into()),
        unreachable: None,
        detail: None,
    }
}

/// A request admitted at `at`, its first attempt a 503 asking for 100 ms, its second a 200.
async fn salvaged(store: &dyn Store, key: &str, at: Timestamp) -> Vec<Attempt> {
    let id = admitted(store, "payments", key, at, true).await;
    let first = attempt(1, at, 503, Some(100));
    let wait = AttemptEnd::Wait { not_before: at + ms(120) };
    store
        .attempt_ended(AttemptEnded {
            id,
            holder: Holder { owner: WORKER.into(), token: ClaimToken::FIRST },
            attempt: Some(first.clone()),
            then: wait,
            now: at + ms(20),
            stream: None,
        })
        .await
        .unwrap();
    store
        .attempt_started(AttemptStarted {
            id,
            holder: Holder { owner: WORKER.into(), token: ClaimToken::FIRST },
            number: 2,
            started_at: at + ms(120),
            lease: ms(14_880),
            reach: ms(12_000),
            policy_version: VERSION.into(),
        })
        .await
        .unwrap();
    let second = attempt(2, at + ms(120), 200, None);
    let done = AttemptEnd::Done(
        StopReason::Success,
        StoredResponse { status: 200, headers: vec![], body: Bytes::from_static(b"ok") },
    );
    store
        .attempt_ended(AttemptEnded {
            id,
            holder: Holder { owner: WORKER.into(), token: ClaimToken::FIRST },
            attempt: Some(second.clone()),
            then: done,
            now: at + ms(140),
            stream: None,
        })
        .await
        .unwrap();
    vec![first, second]
}

async fn admitted(store: &dyn Store, route: &str, key: &str, at: Timestamp, claimed: bool) -> RecordId {
    match store
        .admit(Admit { new: request(route, key, at, claimed), retention_cutoff: Timestamp::EPOCH })
        .await
        .unwrap()
    {
        idem::store::Admission::Created(record) => record.id,
        other => panic!("expected a new record, got {other:?}"),
    }
}

async fn a_routes_requests_since_a_time_are_read_oldest_first_with_their_attempts(backend: Backend) {
    let db = Db::new(backend).await;
    let store = db.store().await;
    admitted(&*store, "payments", "too-early", T0 - ms(1), false).await;
    let attempts = salvaged(&*store, "b", T0 + ms(20)).await;
    admitted(&*store, "payments", "a-queued", T0, false).await;
    admitted(&*store, "orders", "other-route", T0 + ms(5), false).await;
    admitted(&*store, "payments", "c-sending", T0 + ms(30), true).await;
    // A key freed after one attempt and sent again by its client: one record, two executions.
    let freed = admitted(&*store, "payments", "d-freed", T0 + ms(40), true).await;
    let free = AttemptEnd::Free(StopReason::AttemptCap);
    store
        .attempt_ended(AttemptEnded {
            id: freed,
            holder: Holder { owner: WORKER.into(), token: ClaimToken::FIRST },
            attempt: Some(attempt(1, T0 + ms(40), 503, None)),
            then: free,
            now: T0 + ms(60),
            stream: None,
        })
        .await
        .unwrap();
    let again = NewRecord { id: RecordId::new(), ..request("payments", "d-freed", T0 + ms(900), false) };
    assert!(matches!(
        store.admit(Admit { new: again, retention_cutoff: Timestamp::EPOCH }).await.unwrap(),
        idem::store::Admission::Requeued(_)
    ));

    // Opened while the store that wrote them is still open.
    let reader = Reader::open(&db.url).await.unwrap();
    let page = reader.recorded(&"payments".into(), T0, 100).await.unwrap();
    assert!(!page.cut);
    let found: Vec<_> =
        page.requests.iter().map(|r| (r.created_at, r.state, r.stop_reason, r.in_flight, r.attempts.len())).collect();
    assert_eq!(
        found,
        [
            (T0, State::NotStarted, None, false, 0),
            (T0 + ms(20), State::Done, Some(StopReason::Success), false, 2),
            (T0 + ms(30), State::InProgress, None, true, 0),
            (T0 + ms(40), State::NotStarted, None, false, 1),
        ]
    );
    assert_eq!(page.requests[3].requeued_at, [T0 + ms(900)], "each time the key was sent again");
    assert!(page.requests[1].requeued_at.is_empty());
    assert_eq!(page.requests[1].attempts, attempts, "attempts come back as stored, Retry-After included");
    assert_eq!(page.requests[1].deadline_at, T0 + ms(20) + ms(30_000));

    let page = reader.recorded(&"payments".into(), T0, 2).await.unwrap();
    assert_eq!((page.requests.len(), page.cut), (2, true), "over the limit, the latest are cut and it says so");
    reader.close().await;
}

async fn the_reader_cannot_write(backend: Backend) {
    let db = Db::new(backend).await;
    let store = db.store().await;
    admitted(&*store, "payments", "kept", T0, false).await;
    let reader = Reader::open(&db.url).await.unwrap();
    let deleted = match &reader {
        Reader::Sqlite(pool) => sqlx::query("DELETE FROM records").execute(pool).await.map(drop),
        Reader::Postgres(pool) => sqlx::query("DELETE FROM records").execute(pool).await.map(drop),
    };
    assert!(deleted.is_err(), "a write through the reader went through");
    assert_eq!(reader.recorded(&"payments".into(), Timestamp::EPOCH, 10).await.unwrap().requests.len(), 1);
    reader.close().await;
}

async fn a_database_that_is_not_a_store_is_refused_plainly(backend: Backend) {
    let (url, _dir) = match backend {
        Backend::Sqlite => {
            let dir = tempfile::TempDir::new().unwrap();
            let path = dir.path().join("other.db");
            std::fs::write(&path, b"").unwrap();
            (format!("sqlite://{}", path.display()), Some(dir))
        }
        Backend::Postgres => match postgres_url_for_new_db().await {
            Some(url) => (url, None),
            None => return skipped("recorded"),
        },
    };
    let error = Reader::open(&url).await.err().expect("no Idem tables there").to_string();
    assert!(error.contains("holds no Idem records"), "{error}");
    if backend == Backend::Postgres {
        crate::common::backend::drop_postgres_db(&url).await;
    }
}

#[tokio::test]
async fn a_missing_sqlite_file_is_not_created() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("missing.db");
    let error = Reader::open(&format!("sqlite://{}", path.display())).await.err().expect("no file").to_string();
    assert!(error.contains("does not exist"), "{error}");
    assert!(!path.exists());
}

crate::common::both_stores!(
    a_routes_requests_since_a_time_are_read_oldest_first_with_their_attempts,
    the_reader_cannot_write,
    a_database_that_is_not_a_store_is_refused_plainly,
);
