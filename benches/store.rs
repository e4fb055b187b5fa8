//! Store micro-benchmarks, per backend: the writes on a new key's path (insert-or-get already
//! claimed, then complete) and the read behind a replay. One operation at a time, so each figure
//! is a latency: with SQLite `synchronous=FULL` it includes the commit's fsync.
//! PostgreSQL runs when `IDEM_BENCH_POSTGRES_URL` (or `IDEM_TEST_POSTGRES_URL`) names a server.
//!
//! `file_check_then_sync` times what the SQLite store does around each commit: a page written
//! to a log and synced, then the store's check that the log is still its own, which asks for
//! the inode alone. The baseline beside it asks for everything, file times included, as
//! `std::fs::metadata` does. On Linux 6.13 and later, on ext4 without a journal, that makes the
//! next sync write the inode too.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use idem::domain::fingerprint::Fingerprint;
use idem::domain::key::IdempotencyKey;
use idem::domain::StopReason;
use idem::domain::{AttemptOutcome, Holder, Owner, Tenant, Timestamp};
use idem::record::{Attempt, StoredRequest, StoredResponse};
use idem::store::{self, Admission, AttemptEnd, AttemptEnded, Claim, NewRecord, Store};
use sqlx::Connection;
use uuid::Uuid;

const BODY: &[u8] = br#"{"amount":4200,"currency":"eur","customer":"cus_123","description":"order 42"}"#;

fn new_record(key: &str) -> NewRecord {
    let now = Timestamp::now();
    NewRecord {
        id: idem::domain::RecordId::new(),
        tenant: "default".into(),
        key: IdempotencyKey::from_stored(key.to_string()),
        route: "payments".into(),
        method: http::Method::POST,
        path: "/payments".into(),
        query: String::new(),
        fingerprint: Fingerprint::of("payments", "POST", "/payments", "", None, BODY),
        request: StoredRequest {
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from_static(BODY),
        },
        deadline_at: now + Duration::from_secs(30),
        now,
        policy_version: Some("bench0000000".into()),
        claim: Some(Claim {
            owner: "bench".into(),
            marked_at: now,
            lease: Duration::from_secs(15),
            reach: Duration::from_secs(12),
        }),
        tombstone_cutoff: None,
    }
}

/// The admission of `new`, with no retention cutoff in the way.
fn admit(new: NewRecord) -> store::Admit {
    store::Admit { new, retention_cutoff: Timestamp::from_millis(0) }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(br#"{"id":"pay_123","status":"succeeded"}"#),
    }
}

async fn postgres_url() -> Option<String> {
    let server = std::env::var("IDEM_BENCH_POSTGRES_URL").or_else(|_| std::env::var("IDEM_TEST_POSTGRES_URL")).ok()?;
    let name = format!("idem_bench_{}", Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&server).await.ok()?;
    sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await.ok()?;
    let mut url = reqwest::Url::parse(&server).ok()?;
    url.set_path(&format!("/{name}"));
    Some(url.to_string())
}

fn bench_store(c: &mut Criterion, label: &str, rt: &tokio::runtime::Runtime, store: Arc<dyn Store>) {
    let mut g = c.benchmark_group(format!("store/{label}"));
    let mut n = 0u64;
    g.bench_function("admit_new_key", |b| {
        b.iter(|| {
            n += 1;
            rt.block_on(store.admit(admit(new_record(&format!("admit-{n}"))))).unwrap()
        })
    });
    g.bench_function("admit_then_complete", |b| {
        b.iter(|| {
            n += 1;
            rt.block_on(async {
                let Admission::Created(r) = store.admit(admit(new_record(&format!("full-{n}")))).await.unwrap() else {
                    panic!("not created")
                };
                let attempt = Attempt {
                    number: 1,
                    started_at: Timestamp::now(),
                    duration_ms: 1,
                    outcome: AttemptOutcome::Success,
                    status: Some(201),
                    error: None,
                    wait_ms: 0,
                    policy_version: Some("bench0000000".into()),
                    retry_after_ms: None,
                    unreachable: None,
                    detail: None,
                };
                let then = AttemptEnd::Done(StopReason::Success, response());
                let ended = AttemptEnded {
                    id: r.id,
                    holder: Holder { owner: Owner::from("bench"), token: r.claim },
                    attempt: Some(attempt),
                    then,
                    stream: None,
                    now: Timestamp::now(),
                };
                store.attempt_ended(ended).await.unwrap()
            })
        })
    });
    rt.block_on(store.admit(admit(new_record("replayed")))).unwrap();
    g.bench_function("lookup_existing", |b| {
        b.iter(|| {
            rt.block_on(store.lookup(&Tenant::from("default"), &IdempotencyKey::from_stored("replayed".into())))
                .unwrap()
        })
    });
    g.finish();
}

fn stores(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for (label, query) in [("sqlite_full", ""), ("sqlite_normal", "?synchronous=normal")] {
        let url = format!("sqlite://{}{query}", dir.path().join(format!("{label}.db")).display());
        let store = rt.block_on(store::open(&url)).unwrap();
        bench_store(c, label, &rt, store);
    }
    match rt.block_on(postgres_url()) {
        Some(url) => {
            let store = rt.block_on(store::open(&url)).unwrap();
            bench_store(c, "postgres", &rt, store);
        }
        None => eprintln!("store/postgres skipped: set IDEM_BENCH_POSTGRES_URL to a PostgreSQL server"),
    }
}

/// A page written and synced, then the file checked, in a loop: the check's effect on the next
/// sync. The file is written in full first, so that no write allocates.
#[cfg(unix)]
fn file_check_then_sync(c: &mut Criterion) {
    use std::os::unix::fs::FileExt;

    const SPAN: u64 = 4 << 20;
    const PAGE: usize = 4096;
    let dir = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("log");
    let file = std::fs::File::create(&path).unwrap();
    let zeroes = vec![0u8; 1 << 16];
    for offset in (0..SPAN).step_by(zeroes.len()) {
        file.write_all_at(&zeroes, offset).unwrap();
    }
    file.sync_all().unwrap();
    let page = [7u8; PAGE];
    let mut offset = 0;
    let mut write_and_sync = || {
        file.write_all_at(&page, offset).unwrap();
        file.sync_data().unwrap();
        offset = (offset + PAGE as u64) % SPAN;
    };
    let mut g = c.benchmark_group("file_check_then_sync");
    g.bench_function("full_stat_baseline", |b| {
        b.iter(|| {
            write_and_sync();
            std::fs::metadata(&path).unwrap()
        })
    });
    g.bench_function("store_check", |b| {
        b.iter(|| {
            write_and_sync();
            idem::store::sqlite::FileId::of(&path).unwrap()
        })
    });
    g.finish();
}

#[cfg(not(unix))]
fn file_check_then_sync(_: &mut Criterion) {}

criterion_group!(benches, stores, file_check_then_sync);
criterion_main!(benches);
