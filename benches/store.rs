//! Store micro-benchmarks, per backend: the writes on a new key's path (insert-or-get already
//! claimed, then complete) and the read behind a replay. One operation at a time, so each figure
//! is a latency: with SQLite `synchronous=FULL` it includes the commit's fsync.
//! PostgreSQL runs when `IDEM_BENCH_POSTGRES_URL` (or `IDEM_TEST_POSTGRES_URL`) names a server.
//!
//! `pages_per_commit` counts, rather than times, what a new key's two commits write to SQLite's
//! log: the frames (one page each) of the admission's commit and of the outcome's, on the schema
//! as migrated and on the same schema with the indexes before `0013_fewer_listing_indexes`
//! (`records_listing_by_state` back, the two partial listing indexes gone), in one run. Each
//! store is first filled with `PAGES_SEED` keys, so that its B-trees have their depth.
//!
//! `million` (only with `IDEM_BENCH_MILLION=1`) builds a store of a million records on SQLite,
//! and on PostgreSQL when a server is named, with one bulk `INSERT … SELECT` (most done; the
//! newest few thousand in progress or queued; a few thousand unknown and free spread over the
//! day), then times what reads a large store: the operator's listing of each state (its first
//! page, and a page from the middle), `/admin/stats` over the last hour, a canary's sides, and
//! the count by phase behind `/metrics`. Then it puts back the index that every record was in
//! before (`records_listing_by_state`) and times the statements of the build before on it, for
//! comparison on the same rows (their rows fetched whole but not decoded into records, which
//! the store's listing also does: about half a millisecond a page of 50):
//! `IDEM_BENCH_MILLION=1 cargo bench --bench store -- million`.
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

/// The first attempt of record `id`, claimed under `claim`, ended with a success.
fn ended(id: idem::domain::RecordId, claim: idem::domain::ClaimToken) -> AttemptEnded {
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
    AttemptEnded {
        id,
        holder: Holder { owner: Owner::from("bench"), token: claim },
        attempt: Some(attempt),
        then: AttemptEnd::Done(StopReason::Success, response()),
        stream: None,
        now: Timestamp::now(),
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
                store.attempt_ended(ended(r.id, r.claim)).await.unwrap()
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

/// Keys written before the count, and keys counted.
const PAGES_SEED: u64 = 20_000;
const PAGES_COUNTED: u64 = 500;

/// The frames of the latest commit in the SQLite log at `wal`: those after the commit before it
/// (a frame whose header gives the database's size ends a commit), among the frames of the
/// log's current generation (its salts). The log is read frame header by frame header.
#[cfg(unix)]
fn last_commit_frames(wal: &std::path::Path) -> u64 {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(wal).unwrap();
    let mut header = [0u8; 32];
    file.read_exact_at(&mut header, 0).unwrap();
    let page = u64::from(u32::from_be_bytes(header[8..12].try_into().unwrap()));
    let salts = &header[16..24];
    let (mut frames, mut last_end, mut previous_end) = (0u64, 0u64, 0u64);
    let mut frame = [0u8; 24];
    loop {
        if file.read_exact_at(&mut frame, 32 + frames * (24 + page)).is_err() || &frame[8..16] != salts {
            break;
        }
        frames += 1;
        if frame[4..8] != [0, 0, 0, 0] {
            previous_end = last_end;
            last_end = frames;
        }
    }
    last_end - previous_end
}

/// Frames per commit of a new key's admission and of its outcome, on the schema before the
/// partial listing indexes and after, printed side by side.
#[cfg(unix)]
fn pages_per_commit(_: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut lines = Vec::new();
    for schema in ["before", "after"] {
        let path = dir.path().join(format!("pages_{schema}.db"));
        let url = format!("sqlite://{}?synchronous=normal", path.display());
        let store = rt.block_on(store::open(&url)).unwrap();
        if schema == "before" {
            let conn = rusqlite::Connection::open(&path).unwrap();
            conn.execute_batch(
                "DROP INDEX records_free; DROP INDEX records_listing_unknown;
                 CREATE INDEX records_listing_by_state ON records (state, created_at, id);",
            )
            .unwrap();
        }
        let wal = dir.path().join(format!("pages_{schema}.db-wal"));
        let (mut admissions, mut outcomes) = (0, 0);
        for n in 0..PAGES_SEED + PAGES_COUNTED {
            let counted = n >= PAGES_SEED;
            rt.block_on(async {
                let Admission::Created(r) = store.admit(admit(new_record(&format!("pages-{n}")))).await.unwrap() else {
                    panic!("not created")
                };
                if counted {
                    admissions += last_commit_frames(&wal);
                }
                store.attempt_ended(ended(r.id, r.claim)).await.unwrap();
                if counted {
                    outcomes += last_commit_frames(&wal);
                }
            });
        }
        let per = |frames: u64| frames as f64 / PAGES_COUNTED as f64;
        lines.push(format!(
            "pages_per_commit/{schema}: admission {:.2}, outcome {:.2}, a key {:.2} ({PAGES_COUNTED} keys after {PAGES_SEED})",
            per(admissions),
            per(outcomes),
            per(admissions + outcomes)
        ));
    }
    for schema in ["before", "after"] {
        match rt.block_on(postgres_url()) {
            Some(url) => lines.push(rt.block_on(postgres_pages(&url, schema))),
            None => {
                eprintln!("pages_per_commit/postgres skipped: set IDEM_BENCH_POSTGRES_URL to a PostgreSQL server");
                break;
            }
        }
    }
    for line in lines {
        println!("{line}");
    }
}

#[cfg(not(unix))]
fn pages_per_commit(_: &mut Criterion) {}

/// Keys written before PostgreSQL's count, and keys counted.
const PG_PAGES_SEED: u64 = 5_000;

/// PostgreSQL's counterpart of the frames in SQLite's log: the distinct pages (of this
/// database's relations) that the WAL records of each transaction name, and those records,
/// read back with `pg_walinspect`, for a new key's admission and its outcome on the database at
/// `url` with the indexes of `schema`. The database is dropped after.
async fn postgres_pages(url: &str, schema: &str) -> String {
    use sqlx::{Executor, Row};
    let store = store::open(url).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await.unwrap();
    if let Err(e) = pool.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect").await {
        pool.close().await;
        drop(store);
        drop_database(url).await;
        return format!("pages_per_commit/postgres/{schema} skipped: pg_walinspect: {e}");
    }
    if schema == "before" {
        pool.execute(
            "DROP INDEX records_free; DROP INDEX records_listing_unknown;
             CREATE INDEX records_listing_by_state ON records (state, created_at, id)",
        )
        .await
        .unwrap();
    }
    let mut start = String::new();
    for n in 0..PG_PAGES_SEED + PAGES_COUNTED {
        if n == PG_PAGES_SEED {
            start = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&pool).await.unwrap();
        }
        let Admission::Created(r) = store.admit(admit(new_record(&format!("pages-{n}")))).await.unwrap() else {
            panic!("not created")
        };
        store.attempt_ended(ended(r.id, r.claim)).await.unwrap();
    }
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&pool).await.unwrap();
    let rows = sqlx::query(
        "SELECT admission, count(*) AS transactions, avg(pages)::float8 AS pages, avg(records)::float8 AS records
         FROM (SELECT w.xid::text AS xid, bool_or(w.resource_manager = 'Heap' AND w.record_type LIKE 'INSERT%') AS admission,
                      count(DISTINCT b.page) AS pages, count(DISTINCT w.start_lsn) AS records
               FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) AS w,
                    LATERAL (SELECT m[1] AS page
                             FROM regexp_matches(w.block_ref, '(rel [0-9]+/[0-9]+/[0-9]+ fork [a-z]+ blk [0-9]+)', 'g')
                                  AS m) AS b
               WHERE b.page LIKE '%/' || (SELECT oid FROM pg_database WHERE datname = current_database()) || '/%'
               GROUP BY w.xid::text) AS t
         GROUP BY admission ORDER BY admission DESC",
    )
    .bind(&start)
    .bind(&end)
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut line = format!("pages_per_commit/postgres/{schema}:");
    for row in rows {
        let kind = if row.get::<bool, _>("admission") { "admission" } else { "outcome" };
        line += &format!(
            " {kind} {:.2} pages in {:.2} WAL records ({} transactions);",
            row.get::<f64, _>("pages"),
            row.get::<f64, _>("records"),
            row.get::<i64, _>("transactions")
        );
    }
    pool.close().await;
    drop(store);
    drop_database(url).await;
    line + &format!(" {PAGES_COUNTED} keys after {PG_PAGES_SEED}")
}

/// Drops the bench's database at `url`, ending what is still connected to it.
async fn drop_database(url: &str) {
    let server = std::env::var("IDEM_BENCH_POSTGRES_URL").or_else(|_| std::env::var("IDEM_TEST_POSTGRES_URL")).unwrap();
    let name = reqwest::Url::parse(url).unwrap().path().trim_start_matches('/').to_string();
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    sqlx::query(&format!("DROP DATABASE \"{name}\" WITH (FORCE)")).execute(&mut admin).await.unwrap();
}

/// Records in the `million` store, and how many of them are the newest, in progress or queued.
const MILLION: i64 = 1_000_000;
const NEWEST: i64 = 4_000;

/// A row per record `i` of `0..MILLION`, created over the last day, one every 86.4 ms: the
/// newest `NEWEST` in progress (even) or queued (one in four) or done, and of the others one in
/// 500 unknown, one in 1,000 free, the rest done; one in ten of route `refunds`. Written for
/// both stores: `$ID` is the id's text, `$SERIES` the numbers, `$BLOB…` bytes, `$NOW` the time.
const MILLION_ROWS: &str = "
SELECT $ID AS id, 'default' AS tenant, 'k' || i AS key,
       CASE WHEN i % 10 = 0 THEN 'refunds' ELSE 'payments' END AS route, 'POST' AS method,
       '/payments' AS path, '' AS query, $BLOB32 AS fingerprint,
       '[[\"content-type\",\"application/json\"]]' AS request_headers, $BLOB200 AS request_body,
       phase, at + 30000 AS deadline_at, at AS created_at, at + 40 AS updated_at,
       CASE WHEN phase = 'done' THEN at + 40 END AS done_at,
       CASE WHEN phase = 'in_progress' THEN 'bench' END AS lease_owner,
       CASE WHEN phase = 'in_progress' THEN $NOW + 15000 END AS lease_expires_at,
       CASE WHEN phase = 'unknown' THEN at + 60000 END AS next_probe_at,
       CASE WHEN phase = 'done' THEN 201 END AS response_status,
       CASE WHEN phase = 'done' THEN '[]' END AS response_headers,
       CASE WHEN phase = 'done' THEN $BLOB100 END AS response_body,
       CASE phase WHEN 'done' THEN 'success' WHEN 'unknown' THEN 'unsafe_replay' END AS stop_reason,
       '[]' AS attempts,
       CASE WHEN phase IN ('in_progress', 'done', 'unknown') THEN 1 ELSE 0 END AS claim_token,
       'bench0000000' AS policy_version
FROM (SELECT i, $NOW - 86400000 + (i * 864) / 10 AS at,
             CASE WHEN i >= $MILLION - $NEWEST THEN
                      CASE WHEN i % 2 = 0 THEN 'in_progress' WHEN i % 4 = 1 THEN 'queued' ELSE 'done' END
                  WHEN i % 500 = 1 THEN 'unknown' WHEN i % 1000 = 2 THEN 'free' ELSE 'done' END AS phase
      FROM $SERIES) AS rows";

fn million_insert(postgres: bool, now: i64) -> String {
    let (id, series, blob32, blob200, blob100) = if postgres {
        (
            "(lpad(to_hex(at), 12, '0') || lpad(to_hex(i), 20, '0'))::uuid",
            "generate_series(0, $MILLION - 1) AS i",
            "decode(md5(i::text) || md5(i::text), 'hex')",
            "decode(repeat(md5(i::text), 12), 'hex')",
            "decode(repeat(md5(i::text), 6), 'hex')",
        )
    } else {
        (
            "lower(printf('%08x-%04x-7000-8000-%012x', at / 65536, at % 65536, i))",
            "(WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < $MILLION - 1) SELECT i FROM n)",
            "randomblob(32)",
            "randomblob(200)",
            "randomblob(100)",
        )
    };
    let rows = MILLION_ROWS
        .replace("$ID", id)
        .replace("$SERIES", series)
        .replace("$BLOB32", blob32)
        .replace("$BLOB200", blob200)
        .replace("$BLOB100", blob100)
        .replace("$MILLION", &MILLION.to_string())
        .replace("$NEWEST", &NEWEST.to_string())
        .replace("$NOW", &now.to_string());
    let state = "CASE WHEN phase IN ('queued', 'free') THEN 'not_started' ELSE phase END";
    let queued = if postgres { "phase = 'queued'" } else { "CASE WHEN phase = 'queued' THEN 1 ELSE 0 END" };
    format!(
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
             request_body, state, queued, deadline_at, created_at, updated_at, done_at, lease_owner,
             lease_expires_at, next_probe_at, response_status, response_headers, response_body,
             stop_reason, attempts, claim_token, policy_version)
         SELECT id, tenant, key, route, method, path, query, fingerprint, request_headers{json},
             request_body, {state}, {queued}, deadline_at, created_at, updated_at, done_at, lease_owner,
             lease_expires_at, next_probe_at, response_status, response_headers{json}, response_body,
             stop_reason, attempts{json}, claim_token, policy_version
         FROM ({rows}) AS million",
        json = if postgres { "::jsonb" } else { "" },
    )
}

/// The median of `runs` timings of `f`, in ms.
fn median_ms<T>(rt: &tokio::runtime::Runtime, runs: usize, mut f: impl FnMut() -> T) -> f64
where
    T: std::future::Future,
{
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let started = std::time::Instant::now();
            rt.block_on(f());
            started.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[runs / 2]
}

/// What reads a large store, timed on a million records of each backend (see the module's
/// documentation).
fn million(_: &mut Criterion) {
    if std::env::var("IDEM_BENCH_MILLION").map_or(true, |v| v != "1") {
        eprintln!("million skipped: set IDEM_BENCH_MILLION=1 to time a store of a million records");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::TempDir::new_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("million.db").display());
    million_on(&rt, "sqlite", &sqlite);
    match rt.block_on(postgres_url()) {
        Some(url) => million_on(&rt, "postgres", &url),
        None => eprintln!("million/postgres skipped: set IDEM_BENCH_POSTGRES_URL to a PostgreSQL server"),
    }
}

fn million_on(rt: &tokio::runtime::Runtime, label: &str, url: &str) {
    use idem::domain::State;
    use idem::store::stats::StatsSpan;
    use idem::store::{Cursor, ListFilter};
    use sqlx::{Executor, Row};

    let postgres = label == "postgres";
    let store = rt.block_on(store::open(url)).unwrap();
    let now = Timestamp::now().as_millis();
    let started = std::time::Instant::now();
    let insert = million_insert(postgres, now);
    if postgres {
        rt.block_on(async {
            let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
            conn.execute(&*format!("SET idem.protocol = '{}'", store::protocol::STORE_PROTOCOL)).await.unwrap();
            conn.execute(&*insert).await.unwrap();
            // As autovacuum would have by the time a store is this large.
            conn.execute("VACUUM ANALYZE records").await.unwrap();
        });
    } else {
        let path = url.trim_start_matches("sqlite://");
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.create_scalar_function(
            "idem_store_protocol",
            0,
            rusqlite::functions::FunctionFlags::SQLITE_DETERMINISTIC,
            |_| Ok(store::protocol::STORE_PROTOCOL),
        )
        .unwrap();
        conn.execute_batch(&insert).unwrap();
        conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
    }
    println!("million/{label}: {MILLION} records written in {:.1} s", started.elapsed().as_secs_f64());

    // The raw statements of the build before, and a cursor in the middle of each state, on a
    // connection of their own.
    enum Raw {
        Postgres(sqlx::PgPool),
        Sqlite(sqlx::SqlitePool),
    }
    let pool = rt.block_on(async {
        if postgres {
            Raw::Postgres(sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await.unwrap())
        } else {
            Raw::Sqlite(sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(url).await.unwrap())
        }
    });
    let raw = |sql: String| -> Vec<(i64, String)> {
        rt.block_on(async {
            match &pool {
                Raw::Postgres(pool) => sqlx::query(&sql)
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| (r.get::<i64, _>(0), r.get::<String, _>(1)))
                    .collect(),
                Raw::Sqlite(pool) => sqlx::query(&sql)
                    .fetch_all(pool)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| (r.get::<i64, _>(0), r.get::<String, _>(1)))
                    .collect(),
            }
        })
    };
    let ddl = |sql: &str| {
        rt.block_on(async {
            match &pool {
                Raw::Postgres(pool) => pool.execute(sql).await.map(drop).unwrap(),
                Raw::Sqlite(pool) => pool.execute(sql).await.map(drop).unwrap(),
            }
        })
    };
    let states = [None, Some(State::Done), Some(State::Unknown), Some(State::InProgress), Some(State::NotStarted)];
    let middle = |state: Option<State>| -> Cursor {
        let (count, filter) = match state {
            None => (MILLION, String::new()),
            Some(s) => {
                let n = raw(format!("SELECT COUNT(*), '' FROM records WHERE state = '{}'", s.as_str()))[0].0;
                (n, format!("WHERE state = '{}'", s.as_str()))
            }
        };
        let id = if postgres { "id::text" } else { "id" };
        let (at, id) = raw(format!(
            "SELECT created_at, {id} FROM records {filter} ORDER BY created_at, id LIMIT 1 OFFSET {}",
            count / 2
        ))
        .remove(0);
        Cursor { created_at: Timestamp::from_millis(at), id: Uuid::parse_str(&id).unwrap() }
    };
    let cursors: Vec<Cursor> = states.iter().map(|s| middle(*s)).collect();
    let name = |state: Option<State>| state.map_or("every state", |s| s.as_str());

    let mut lines = Vec::new();
    for (state, cursor) in states.iter().zip(&cursors) {
        let first = ListFilter { state: *state, limit: 50, ..ListFilter::default() };
        let later = ListFilter { cursor: Some(*cursor), ..first.clone() };
        let (store1, store2) = (store.clone(), store.clone());
        let t1 = median_ms(rt, 5, || {
            let (store, filter) = (store1.clone(), first.clone());
            async move { assert!(!store.list(&filter).await.unwrap().items.is_empty()) }
        });
        let t2 = median_ms(rt, 5, || {
            let (store, filter) = (store2.clone(), later.clone());
            async move { assert!(!store.list(&filter).await.unwrap().items.is_empty()) }
        });
        lines.push(format!("list {:<12} first page {t1:>8.2} ms, from the middle {t2:>8.2} ms", name(*state)));
    }
    let hour = StatsSpan {
        start: Timestamp::from_millis((now / 10_000) * 10_000 - 3_600_000),
        end: Timestamp::from_millis((now / 10_000) * 10_000),
        step: Duration::from_secs(10),
        route: None,
    };
    let t = median_ms(rt, 5, || {
        let (store, span) = (store.clone(), hour.clone());
        async move { store.stats(&span).await.unwrap() }
    });
    lines.push(format!("/admin/stats, the last hour in 10 s steps: {t:.2} ms"));
    let t = median_ms(rt, 5, || {
        let store = store.clone();
        async move { store.sides(&"payments".into(), Timestamp::from_millis(now - 3_600_000)).await.unwrap() }
    });
    lines.push(format!("a canary's sides over the last hour: {t:.2} ms"));
    let counted = rt.block_on(store.count_by_phase()).unwrap();
    let t = median_ms(rt, 5, || {
        let store = store.clone();
        async move { store.count_by_phase().await.unwrap() }
    });
    lines.push(format!("count by phase: {t:.2} ms {counted:?}"));

    // The build before: its index back, its statements on it.
    let by_state = "CREATE INDEX records_listing_by_state ON records (state, created_at, id)";
    let started = std::time::Instant::now();
    ddl(by_state);
    if postgres {
        ddl("ANALYZE records");
    }
    lines.push(format!("(records_listing_by_state built again in {:.1} s)", started.elapsed().as_secs_f64()));
    let before_list = |state: Option<State>, cursor: Option<Cursor>| {
        let state = state.map_or("NULL".to_string(), |s| format!("'{}'", s.as_str()));
        let (at, id) = cursor.map_or(("NULL".to_string(), "NULL".to_string()), |c| {
            (c.created_at.as_millis().to_string(), format!("'{}'", c.id))
        });
        if postgres {
            format!(
                "SELECT created_at, id::text, page.* FROM (SELECT * FROM records
                 WHERE ({state}::text IS NULL OR state = {state}) AND (NULL::text IS NULL OR route = NULL)
                   AND (NULL::text IS NULL OR tenant = NULL)
                   AND ({at}::bigint IS NULL OR (created_at, id) > ({at}, {id}::uuid))
                 ORDER BY created_at, id LIMIT 51) AS page"
            )
        } else {
            format!(
                "SELECT created_at, id, page.* FROM (SELECT * FROM records
                 WHERE ({state} IS NULL OR state = {state}) AND (NULL IS NULL OR route = NULL)
                   AND (NULL IS NULL OR tenant = NULL)
                   AND ({at} IS NULL OR (created_at, id) > ({at}, {id}))
                 ORDER BY created_at, id LIMIT 51) AS page"
            )
        }
    };
    for (state, cursor) in states.iter().zip(&cursors) {
        let (first, later) = (before_list(*state, None), before_list(*state, Some(*cursor)));
        let t1 = median_ms(rt, 3, || {
            let rows = raw(first.clone());
            async move { assert!(!rows.is_empty()) }
        });
        let t2 = median_ms(rt, 3, || {
            let rows = raw(later.clone());
            async move { assert!(!rows.is_empty()) }
        });
        lines.push(format!("before: list {:<12} first page {t1:>8.2} ms, from the middle {t2:>8.2} ms", name(*state)));
    }
    let t = median_ms(rt, 3, || {
        let rows = raw("SELECT COUNT(*), state FROM records GROUP BY state, queued".into());
        async move { assert!(!rows.is_empty()) }
    });
    lines.push(format!("before: count by phase: {t:.2} ms"));
    for line in lines {
        println!("million/{label}: {line}");
    }
    drop(pool);
    drop(store);
    if postgres {
        rt.block_on(drop_database(url));
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

criterion_group!(benches, pages_per_commit, million, stores, file_check_then_sync);
criterion_main!(benches);
