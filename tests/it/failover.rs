//! The PostgreSQL store through the faults of a failover (docs/high-availability.md): a store
//! URL naming several hosts, the first of them down; the serving host going away, and the
//! broker following to the next without a restart; and a write whose answer is lost — the
//! connection cut before the server sees the statement, or after it committed it — settled by
//! reading the record back, never taken as "not written". The hosts are proxies in front of the
//! one test server ([`Wire`]), so a test decides which connection dies and when; the soak fails
//! over a real primary to its real standby (`benches/soak.rs`).

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::backend::{self, Backend};
use crate::common::wire::{Cut, Wire};
use crate::common::{send, Broker, Db, Reply, TestConfig, Upstream};

/// `db`'s URL with `hosts` for its host list and `query` for its parameters, without TLS: the
/// proxies read the messages.
fn url_with_hosts(db: &Db, hosts: &[String], query: &str) -> String {
    let url = reqwest::Url::parse(&db.url).unwrap();
    let user = url.username();
    format!("postgres://{user}@{}{}?sslmode=disable{query}", hosts.join(","), url.path())
}

/// The server the test database lives on, as `host:port`.
fn server_of(db: &Db) -> String {
    let url = reqwest::Url::parse(&db.url).unwrap();
    format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432))
}

/// A PostgreSQL database for the test, or `None` (skipped) without a server.
async fn postgres(test: &str) -> Option<Db> {
    if backend::postgres_server_url().is_none() {
        backend::skipped(test);
        return None;
    }
    Some(Db::new(Backend::Postgres).await)
}

async fn node(broker: &Broker) -> Value {
    send(broker.http.get(format!("{}/admin/node", broker.admin))).await.json()
}

/// Posts `key` until the broker answers 201 (a store that is failing over refuses with 503);
/// fails after `within`. How long it took.
async fn created_within(broker: &Broker, key: &str, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let r = send(broker.post("/payments", key, r#"{"amount":1}"#)).await;
        if r.status == 201 {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{key} still not created after {within:?}: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_url_whose_first_host_is_down_is_served_by_the_next_which_the_node_names() {
    let Some(db) = postgres("failover::a_url_whose_first_host_is_down_is_served_by_the_next").await else { return };
    let (first, second) = (Wire::start(&server_of(&db)).await, Wire::start(&server_of(&db)).await);
    first.set_down(true);
    let hosts = [first.addr.to_string(), second.addr.to_string()];
    let url = url_with_hosts(&db, &hosts, "&target_session_attrs=read-write");
    let upstream = Upstream::start().await;
    let broker = Broker::start_with(&db, TestConfig::new(&upstream.url()).store(&url).text()).await;
    assert_eq!(send(broker.post("/payments", "served", r#"{"amount":1}"#)).await.status, 201);
    let store = &node(&broker).await["store"];
    assert_eq!(store["host"], second.addr.to_string(), "{store}");
    assert!(store["timeline"].as_str().is_some_and(|t| t.len() == 8), "{store}");
    assert_eq!(store["changes"], 0, "{store}");
    broker.stop().await;
}

#[tokio::test]
async fn when_the_serving_host_goes_the_broker_follows_to_the_next_without_a_restart() {
    let Some(db) = postgres("failover::when_the_serving_host_goes_the_broker_follows").await else { return };
    let (first, second) = (Wire::start(&server_of(&db)).await, Wire::start(&server_of(&db)).await);
    let url = url_with_hosts(&db, &[first.addr.to_string(), second.addr.to_string()], "");
    let upstream = Upstream::start().await;
    let broker = Broker::start_with(&db, TestConfig::new(&upstream.url()).store(&url).text()).await;
    created_within(&broker, "before", Duration::from_secs(1)).await;
    assert_eq!(node(&broker).await["store"]["host"], first.addr.to_string());

    first.set_down(true);
    let took = created_within(&broker, "after", Duration::from_secs(10)).await;
    let store = &node(&broker).await["store"];
    assert_eq!((&store["host"], &store["changes"]), (&second.addr.to_string().into(), &1.into()), "{store}");
    // The key recorded before the move is still answered: one store, reached another way.
    let replay = send(broker.post("/payments", "before", r#"{"amount":1}"#)).await;
    assert_eq!((replay.status, upstream.hits("before")), (201, 1), "{replay:?}");
    eprintln!("a new key was answered {took:?} after the serving host went down");
    broker.stop().await;
}

/// A route that is not replay-safe, whose first attempt at `key` the upstream refuses with 503
/// (not processed, so a second is made): that second attempt's mark is the statement cut.
async fn broker_through(db: &Db, wire: &Wire, upstream: &Upstream, key: &str) -> Broker {
    upstream.script(key, vec![Reply::status(503), Reply::status(201)]);
    let url = url_with_hosts(db, &[wire.addr.to_string()], "");
    let config = TestConfig::new(&upstream.url())
        .store(&url)
        .route("replay_safe = false")
        .worker("lease = \"30s\"")
        .tables("[routes.retry]\nbase = \"10ms\"\nmax_attempts = 3\n");
    Broker::start_with(db, config.text()).await
}

/// The mark of an attempt (`UPDATE records SET in_flight_number`), as the store writes it.
const MARK: &str = "SET in_flight_number";

#[tokio::test]
async fn a_mark_committed_whose_answer_is_lost_is_read_back_and_its_attempt_sent_once() {
    let Some(db) = postgres("failover::a_mark_committed_whose_answer_is_lost").await else { return };
    let (wire, upstream) = (Wire::start(&server_of(&db)).await, Upstream::start().await);
    let broker = broker_through(&db, &wire, &upstream, "marked").await;
    wire.cut_at(MARK, Cut::AfterCommit);
    // Within a third of the lease: without the read-back, the attempt is not sent, its lease
    // runs out, and the marked record is taken over to `unknown`.
    let r = tokio::time::timeout(Duration::from_secs(10), send(broker.post("/payments", "marked", r#"{"amount":1}"#)))
        .await
        .expect("answered within a third of the lease");
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(wire.cuts(), 1, "the mark's answer was lost");
    assert_eq!(upstream.hits("marked"), 2, "the 503, then the marked attempt, once");
    let record = broker.record_json("marked").await;
    assert_eq!((&record["state"], record["attempts"].as_array().map(Vec::len)), (&"done".into(), Some(2)), "{record}");
    broker.stop().await;
}

#[tokio::test]
async fn a_mark_the_server_never_saw_sends_nothing_and_the_record_is_handed_back_at_once() {
    let Some(db) = postgres("failover::a_mark_the_server_never_saw").await else { return };
    let (wire, upstream) = (Wire::start(&server_of(&db)).await, Upstream::start().await);
    let broker = broker_through(&db, &wire, &upstream, "unmarked").await;
    wire.cut_at(MARK, Cut::Before);
    // Handed back, it is claimed again and its attempt marked and sent: well before the lease
    // (30 s) would run out, as it must without the read-back.
    let r =
        tokio::time::timeout(Duration::from_secs(10), send(broker.post("/payments", "unmarked", r#"{"amount":1}"#)))
            .await
            .expect("answered within a third of the lease");
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(wire.cuts(), 1);
    assert_eq!(upstream.hits("unmarked"), 2, "the 503, then one attempt: the unmarked one was never sent");
    broker.stop().await;
}

#[tokio::test]
async fn an_admission_committed_whose_answer_is_lost_is_read_back_and_executed_once() {
    let Some(db) = postgres("failover::an_admission_committed_whose_answer_is_lost").await else { return };
    let (wire, upstream) = (Wire::start(&server_of(&db)).await, Upstream::start().await);
    let url = url_with_hosts(&db, &[wire.addr.to_string()], "");
    let config = TestConfig::new(&upstream.url()).store(&url).route("replay_safe = false").worker("lease = \"30s\"");
    let broker = Broker::start_with(&db, config.text()).await;
    wire.cut_at("INSERT INTO records", Cut::AfterCommit);
    // The insert claimed the record and marked its first attempt: read back, it is this
    // request's own, and goes. Without the read-back the client is refused with 503, and the
    // record it left claimed and marked ends `unknown` when its lease runs out.
    let r = send(broker.post("/payments", "admitted", r#"{"amount":1}"#)).await;
    assert_eq!((r.status, wire.cuts()), (201, 1), "{r:?}");
    assert_eq!(upstream.hits("admitted"), 1);
    assert_eq!(broker.record_json("admitted").await["state"], "done");
    broker.stop().await;
}

/// `idem check --connect` connects, changing nothing: it names the host of several that
/// serves, that server's timeline, the store's protocol, and warns, naming the setting, that a
/// primary without a synchronous standby (the test server's) may lose acknowledged commits in a
/// failover. A store it cannot reach fails it.
#[tokio::test]
async fn check_connect_names_the_serving_host_and_warns_of_a_primary_without_a_synchronous_standby() {
    let Some(db) = postgres("failover::check_connect_names_the_serving_host").await else { return };
    let (first, second) = (Wire::start(&server_of(&db)).await, Wire::start(&server_of(&db)).await);
    first.set_down(true);
    let url = url_with_hosts(&db, &[first.addr.to_string(), second.addr.to_string()], "");
    let dir = tempfile::TempDir::new().unwrap();
    let config = dir.path().join("idem.toml");
    let upstream = Upstream::start().await;
    std::fs::write(&config, TestConfig::new(&upstream.url()).store(&url).text()).unwrap();
    // Run without blocking: the proxies serve on this test's runtime.
    let check = |args: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(args);
        async move {
            let out = command.output().await.unwrap();
            let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        }
    };
    let path = config.to_str().unwrap();

    let (ok, stdout, stderr) = check(&["check", "--config", path]).await;
    assert!(ok && !stdout.contains("serving host"), "without --connect nothing connects:\n{stdout}{stderr}");

    let (ok, stdout, stderr) = check(&["check", "--config", path, "--connect"]).await;
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains(&format!("serving host     {} (timeline 0000000", second.addr)), "{stdout}");
    assert!(stdout.contains("replication      synchronous_standby_names (empty)"), "{stdout}");
    assert!(stdout.contains("protocol"), "{stdout}");
    assert!(stderr.contains("warning:") && stderr.contains("synchronous_standby_names is empty"), "{stderr}");
    assert!(stdout.contains(&format!("upstream         payments {} ok", upstream.url())), "{stdout}");
    // Nothing was changed: the database has no schema yet.
    let tables: i64 = {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(tables, 0, "check --connect created nothing");

    // An upstream nothing listens for is reported, and fails the check.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    std::fs::write(&config, TestConfig::new(&format!("http://{closed}")).store(&url).text()).unwrap();
    let (ok, stdout, stderr) = check(&["check", "--config", path, "--connect"]).await;
    assert!(!ok && stdout.contains("upstream         payments") && stdout.contains("failed"), "{stdout}");
    assert!(stderr.contains(&format!("cannot reach the upstream of payments (http://{closed})")), "{stderr}");

    second.set_down(true);
    let (ok, _, stderr) = check(&["check", "--config", path, "--connect"]).await;
    assert!(!ok && stderr.contains("no host of the store takes writes"), "{stderr}");
}

/// A serving host that goes silent (powered off, cut off by the network: nothing refused,
/// nothing answered) is left as one that refuses is: the health check gives up on it within its
/// own bound, and the node moves to the next host and is ready again, without a restart. (What
/// it does not yet do: statements already sent to the silent server hold their connections
/// until the operating system gives up on them; see docs/high-availability.md.)
#[tokio::test]
async fn when_the_serving_host_goes_silent_the_node_moves_to_the_next() {
    let Some(db) = postgres("failover::when_the_serving_host_goes_silent").await else { return };
    let (first, second) = (Wire::start(&server_of(&db)).await, Wire::start(&server_of(&db)).await);
    let url = url_with_hosts(&db, &[first.addr.to_string(), second.addr.to_string()], "");
    let upstream = Upstream::start().await;
    let broker = Broker::start_with(&db, TestConfig::new(&upstream.url()).store(&url).text()).await;
    created_within(&broker, "before-silence", Duration::from_secs(1)).await;

    first.set_silent();
    let start = Instant::now();
    loop {
        let store = node(&broker).await["store"].clone();
        let ready = broker.http.get(format!("{}/readyz", broker.admin)).send().await.unwrap().status();
        if store["host"] == second.addr.to_string() && ready == 200 {
            assert_eq!(store["changes"], 1, "{store}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "still on the silent host: {store}, /readyz {ready}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("moved and ready {:?} after the serving host went silent", start.elapsed());
    broker.stop().await;
}
