//! A store lost under a running broker process (docs/security.md): its SQLite file deleted, replaced or
//! moved away, its PostgreSQL database closed to connections. Within about a second the broker
//! fails closed — new keys get 503 `store-unavailable` and nothing reaches the upstream,
//! `/readyz` answers 503, `idem_store_available` is 0 — and it recovers by itself where the
//! store's own data comes back.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::process::{node_config, Node};
use crate::common::{backend, send, Backend, Db, Gate, Reply, TestConfig, Upstream};
use sqlx::{Connection, PgConnection};

const BODY: &str = r#"{"amount":42}"#;
/// How long the broker may take to notice that its store was lost, or is back.
const NOTICED_WITHIN: Duration = Duration::from_secs(2);

struct Rig {
    upstream: Upstream,
    node: Node,
    db: Db,
}

async fn rig(backend: Backend) -> Rig {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let node = Node::start("broker", &node_config(&db.url, TestConfig::new(&upstream.url())).body()).await;
    Rig { upstream, node, db }
}

impl Rig {
    fn sqlite_path(&self) -> PathBuf {
        PathBuf::from(self.db.url.strip_prefix("sqlite://").expect("a SQLite store"))
    }

    async fn ready_status(&self) -> u16 {
        let r = self.node.http.get(format!("{}/readyz", self.node.admin)).send().await.unwrap();
        r.status().as_u16()
    }

    /// Polls `/readyz` until it answers `status`; fails after [`NOTICED_WITHIN`].
    async fn await_ready_status(&self, status: u16) {
        let until = Instant::now() + NOTICED_WITHIN;
        loop {
            let now = self.ready_status().await;
            if now == status {
                return;
            }
            assert!(Instant::now() < until, "/readyz still answers {now}, not {status}, after {NOTICED_WITHIN:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `idem_store_available` as `/metrics` shows it.
    async fn store_available(&self) -> Option<f64> {
        self.node
            .metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix("idem_store_available "))
            .map(|v| v.trim().parse().unwrap())
    }

    /// Polls the gauge until it reads `value`; fails after [`NOTICED_WITHIN`].
    async fn await_store_available(&self, value: f64) {
        let until = Instant::now() + NOTICED_WITHIN;
        loop {
            let now = self.store_available().await;
            if now == Some(value) {
                return;
            }
            assert!(Instant::now() < until, "idem_store_available is {now:?}, not {value}, after {NOTICED_WITHIN:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// New keys are refused with 503 `store-unavailable`, and none reaches the upstream.
    async fn assert_refuses(&self, keys: &[&str]) {
        for key in keys {
            let r = send(self.node.post("/payments", key, BODY)).await;
            r.assert_problem(503, "store-unavailable");
            assert!(r.header("retry-after").is_some(), "{key}");
        }
        for key in keys {
            assert_eq!(self.upstream.hits(key), 0, "{key} was sent upstream without a durable record");
        }
    }

    /// Error lines the broker has logged so far. Lines reach the file in batches, within
    /// `idem::observe::logs::GATHER` of being logged: wait that out, with room to spare, before counting.
    async fn errors_logged(&self) -> usize {
        tokio::time::sleep(idem::observe::logs::GATHER * 4).await;
        self.node.log_tail(usize::MAX).lines().filter(|l| l.contains("ERROR")).count()
    }
}

async fn a_deleted_database_file_is_noticed_and_no_new_file_is_ever_adopted() {
    let rig = rig(Backend::Sqlite).await;
    assert_eq!(send(rig.node.post("/payments", "before", BODY)).await.status, 201);
    let path = rig.sqlite_path();

    std::fs::remove_file(&path).unwrap();
    // Not even the first key after the loss is acknowledged: its commit went to a file that no
    // path names any more, and after a restart it would be forgotten and executed again.
    rig.assert_refuses(&["right-after"]).await;
    rig.await_ready_status(503).await;
    rig.await_store_available(0.0).await;

    // Many requests during the outage, and the log does not say so for each of them.
    let errors_before = rig.errors_logged().await;
    let started = Instant::now();
    let keys: Vec<String> = (0..20).map(|i| format!("during-{i}")).collect();
    rig.assert_refuses(&keys.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let errors = rig.errors_logged().await - errors_before;
    let allowed = started.elapsed().as_secs() as usize + 2;
    assert!(errors <= allowed, "{errors} error lines in {:?}:\n{}", started.elapsed(), rig.node.log_tail(40));

    // A new, empty database at the path would forget every key: it is not taken up.
    std::fs::write(&path, b"").unwrap();
    let watched = Instant::now() + Duration::from_secs(1);
    while Instant::now() < watched {
        assert_eq!(rig.ready_status().await, 503, "a fresh file at the path was adopted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.assert_refuses(&["with-a-fresh-file"]).await;
    // What was acknowledged before the loss is still answered as it was, never executed again.
    let replay = send(rig.node.post("/payments", "before", BODY)).await;
    assert!(matches!(replay.status, 201 | 503), "{replay:?}");
    assert_eq!(rig.upstream.hits("before"), 1);
}

async fn a_database_file_replaced_by_a_copy_of_itself_is_noticed() {
    let rig = rig(Backend::Sqlite).await;
    assert_eq!(send(rig.node.post("/payments", "before", BODY)).await.status, 201);
    let path = rig.sqlite_path();

    // A backup put back under a running broker: the same content, another file, which lacks
    // whatever the broker acknowledges from now on.
    let copy = path.with_extension("copy");
    std::fs::copy(&path, &copy).unwrap();
    std::fs::rename(&copy, &path).unwrap();

    rig.assert_refuses(&["right-after"]).await;
    rig.await_ready_status(503).await;
    rig.await_store_available(0.0).await;
    rig.assert_refuses(&["later-1", "later-2"]).await;
}

async fn a_database_file_moved_away_and_back_is_used_again() {
    let rig = rig(Backend::Sqlite).await;
    assert_eq!(send(rig.node.post("/payments", "before", BODY)).await.status, 201);
    let path = rig.sqlite_path();
    let aside = path.with_extension("aside");

    std::fs::rename(&path, &aside).unwrap();
    rig.await_ready_status(503).await;
    rig.assert_refuses(&["while-away"]).await;
    rig.await_store_available(0.0).await;

    std::fs::rename(&aside, &path).unwrap();
    rig.await_ready_status(200).await;
    rig.await_store_available(1.0).await;
    let r = send(rig.node.post("/payments", "while-away", BODY)).await;
    assert_eq!(r.status, 201, "the key refused during the outage executes now: {r:?}");
    assert_eq!(rig.upstream.hits("while-away"), 1);
    let replay = send(rig.node.post("/payments", "before", BODY)).await;
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(rig.upstream.hits("before"), 1);
    // The store is the one it was: what it acknowledged before the outage is still there.
    assert_eq!(rig.node.record("before").await.unwrap()["state"], "done");
}

/// Connections to the test database are refused, and those open are ended (`allow` false), or
/// allowed again.
async fn allow_connections(url: &str, allow: bool) {
    let server = backend::postgres_server_url().unwrap();
    let name = reqwest::Url::parse(url).unwrap().path().trim_start_matches('/').to_string();
    let mut admin = PgConnection::connect(&server).await.unwrap();
    sqlx::query(&format!("ALTER DATABASE \"{name}\" WITH ALLOW_CONNECTIONS {allow}"))
        .execute(&mut admin)
        .await
        .unwrap();
    if !allow {
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(&name)
            .execute(&mut admin)
            .await
            .unwrap();
    }
    admin.close().await.unwrap();
}

async fn a_postgres_database_that_refuses_connections_is_noticed_and_used_again_once_it_accepts_them() {
    let rig = rig(Backend::Postgres).await;
    assert_eq!(send(rig.node.post("/payments", "before", BODY)).await.status, 201);

    allow_connections(&rig.db.url, false).await;
    rig.await_ready_status(503).await;
    rig.await_store_available(0.0).await;
    rig.assert_refuses(&["during-1", "during-2"]).await;

    allow_connections(&rig.db.url, true).await;
    rig.await_ready_status(200).await;
    rig.await_store_available(1.0).await;
    assert_eq!(send(rig.node.post("/payments", "during-1", BODY)).await.status, 201);
    assert_eq!(rig.upstream.hits("during-1"), 1);
}

/// The store is lost after the upstream received a request and before it answered: the outcome
/// cannot be stored when it comes. The client is told what executed (the upstream's answer,
/// marked `idem-recorded: false`), never `store-unavailable`; the operator sees it (an error line,
/// the metrics, `/admin/node`); and once the store is back, the outcome is written and replayed.
async fn an_executed_send_whose_outcome_cannot_be_stored_is_told_as_executed_and_stored_later(
    backend: Backend,
    lose: impl AsyncFnOnce(&Rig),
    restore: impl AsyncFnOnce(&Rig),
) {
    let rig = rig(backend).await;
    let gate = Gate::closed();
    rig.upstream.script("executed", vec![Reply::status(201).held_by(&gate)]);
    let client = tokio::spawn(send(rig.node.post("/payments", "executed", BODY)));
    rig.upstream.await_hits("executed", 1).await;
    lose(&rig).await;
    rig.await_ready_status(503).await;
    gate.open();

    let answer = client.await.unwrap();
    // For a failure's message: what has reached the file so far.
    let log = || rig.node.log_tail(80);
    assert_eq!((answer.status, &answer.body[..]), (201, &br#"{"status":201}"#[..]), "{answer:?}\n{}", log());
    assert_eq!(answer.header("idem-recorded"), Some("false"), "{}", log());
    assert_eq!(answer.header("idempotency-status"), Some("done"));
    let metrics = rig.node.metrics().await;
    assert!(metrics.contains("idem_outcomes_unrecorded_total{route=\"payments\"} 1"), "{metrics}");
    assert!(metrics.contains("idem_unrecorded_outcomes 1"), "{metrics}");
    let node: serde_json::Value =
        rig.node.http.get(format!("{}/admin/node", rig.node.admin)).send().await.unwrap().json().await.unwrap();
    assert_eq!(node["unrecorded_outcomes"], 1, "{node}");
    rig.node
        .await_log_line(|l| l.contains("ERROR") && l.contains("could not take the outcome") && l.contains("201"))
        .await;

    restore(&rig).await;
    rig.await_ready_status(200).await;
    rig.await_store_available(1.0).await;
    let until = Instant::now() + Duration::from_secs(10);
    let record = loop {
        let record = rig.node.record("executed").await.unwrap();
        if record["state"] == "done" || Instant::now() > until {
            break record;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((&record["state"], &record["response"]["status"]), (&"done".into(), &201.into()), "{record:#}");
    let replay = send(rig.node.post("/payments", "executed", BODY)).await;
    assert_eq!((replay.status, &replay.body, replay.header("idempotent-replayed")), (201, &answer.body, Some("true")));
    assert_eq!(rig.upstream.hits("executed"), 1, "executed once");
    assert!(rig.node.metrics().await.contains("idem_unrecorded_outcomes 0"));
}

mod sqlite {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_executed_send_whose_outcome_cannot_be_stored_is_told_as_executed_and_stored_later() {
        let aside = |rig: &super::Rig| rig.sqlite_path().with_extension("aside");
        super::an_executed_send_whose_outcome_cannot_be_stored_is_told_as_executed_and_stored_later(
            super::Backend::Sqlite,
            async |rig| std::fs::rename(rig.sqlite_path(), aside(rig)).unwrap(),
            async |rig| std::fs::rename(aside(rig), rig.sqlite_path()).unwrap(),
        )
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deleted_database_file_is_noticed_and_no_new_file_is_ever_adopted() {
        super::a_deleted_database_file_is_noticed_and_no_new_file_is_ever_adopted().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_file_replaced_by_a_copy_of_itself_is_noticed() {
        super::a_database_file_replaced_by_a_copy_of_itself_is_noticed().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_file_moved_away_and_back_is_used_again() {
        super::a_database_file_moved_away_and_back_is_used_again().await
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_database_that_refuses_connections_is_noticed_and_used_again_once_it_accepts_them() {
        if super::backend::postgres_server_url().is_none() {
            return super::backend::skipped("postgres::a_database_that_refuses_connections_is_noticed");
        }
        super::a_postgres_database_that_refuses_connections_is_noticed_and_used_again_once_it_accepts_them().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_executed_send_whose_outcome_cannot_be_stored_is_told_as_executed_and_stored_later() {
        if super::backend::postgres_server_url().is_none() {
            return super::backend::skipped("postgres::an_executed_send_whose_outcome_cannot_be_stored");
        }
        super::an_executed_send_whose_outcome_cannot_be_stored_is_told_as_executed_and_stored_later(
            super::Backend::Postgres,
            async |rig| super::allow_connections(&rig.db.url, false).await,
            async |rig| super::allow_connections(&rig.db.url, true).await,
        )
        .await
    }
}

/// A record that cannot be read back (a row edited by hand) is told as what it is: 500
/// `record-unreadable`, which no retry helps, never 503 `store-unavailable`, which a client
/// would wait out and retry for ever; the broker's store is up meanwhile.
#[tokio::test]
async fn an_unreadable_record_is_told_as_such_not_as_an_outage() {
    let rig = rig(Backend::Sqlite).await;
    assert_eq!(send(rig.node.post("/payments", "hand-edited", BODY)).await.status, 201);
    let file = rig.db.url.trim_start_matches("sqlite://").to_string();
    let conn = rusqlite::Connection::open(&file).unwrap();
    // An operator's shell declares the protocol the store's trigger asks every writer for.
    let protocol = idem::store::protocol::STORE_PROTOCOL;
    conn.create_scalar_function("idem_store_protocol", 0, rusqlite::functions::FunctionFlags::SQLITE_UTF8, move |_| {
        Ok(protocol)
    })
    .unwrap();
    let edited = conn.execute("UPDATE records SET attempts = 'not json' WHERE key = 'hand-edited'", []).unwrap();
    assert_eq!(edited, 1);
    let answer = send(rig.node.http.get(format!("{}/_idem/requests/hand-edited", rig.node.url))).await;
    answer.assert_problem(500, "record-unreadable");
    assert_eq!(answer.header("x-should-retry"), Some("false"));
    assert_eq!(answer.header("retry-after"), None);
    let ready = rig.node.http.get(format!("{}/readyz", rig.node.admin)).send().await.unwrap();
    assert_eq!(ready.status(), 200, "the store itself is up");
}
