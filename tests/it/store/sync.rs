//! `[store] sync` (docs/guarantees.md#power-loss-and-store-sync): the store's connections commit
//! as it says — read back from SQLite's writer (`PRAGMA synchronous`) and from PostgreSQL's
//! sessions (`SHOW synchronous_commit`) — and `/admin/node` and `idem check` tell the setting in
//! force.

use std::process::Command;

use idem::config::Durability;
use idem::store::{self, DurabilityInForce, LeaseClock};

use crate::common::{both_stores, send, Backend, Broker, Db, TestConfig, Upstream};

/// What the backend reports for `sync`: SQLite's `PRAGMA synchronous` (1 NORMAL, 2 FULL),
/// PostgreSQL's `synchronous_commit`.
fn reported(backend: Backend, sync: Durability) -> DurabilityInForce {
    let setting = match (backend, sync) {
        (Backend::Sqlite, Durability::Normal) => "synchronous=NORMAL",
        (Backend::Sqlite, Durability::Full) => "synchronous=FULL",
        (Backend::Postgres, Durability::Normal) => "synchronous_commit=off",
        (Backend::Postgres, Durability::Full) => "synchronous_commit=on",
    };
    DurabilityInForce { sync, setting: setting.into() }
}

/// The settings `backend` takes: `normal` is for SQLite only.
fn settings(backend: Backend) -> &'static [Durability] {
    match backend {
        Backend::Sqlite => &[Durability::Normal, Durability::Full],
        Backend::Postgres => &[Durability::Full],
    }
}

async fn the_store_commits_as_store_sync_says(backend: Backend) {
    for &sync in settings(backend) {
        let db = Db::new(backend).await;
        let opened = store::open_synced(&db.url, sync, LeaseClock::Node).await.unwrap();
        assert_eq!(opened.durability(), reported(backend, sync), "opened with sync {sync}");
        opened.ping().await.unwrap();
        opened.close().await;
    }
}

async fn a_store_opened_without_a_setting_is_fully_durable(backend: Backend) {
    let db = Db::new(backend).await;
    assert_eq!(db.deployed_store().await.durability(), reported(backend, Durability::Full));
}

async fn admin_node_shows_the_sync_in_force(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let both = [("sync = \"normal\"", Durability::Normal), ("", Durability::Full)];
    for (lines, sync) in both.into_iter().filter(|(_, sync)| settings(backend).contains(sync)) {
        let config = TestConfig::new(&upstream.url()).store_lines(lines);
        let broker = Broker::start(&db, config).await;
        let node: serde_json::Value = send(broker.http.get(format!("{}/admin/node", broker.admin))).await.json();
        let expected = reported(backend, sync);
        assert_eq!(node["store"]["sync"], expected.sync.as_str(), "{lines:?}: {node}");
        assert_eq!(node["store"]["setting"], expected.setting.as_str(), "{lines:?}: {node}");
        broker.stop().await;
    }
}

both_stores!(
    the_store_commits_as_store_sync_says,
    a_store_opened_without_a_setting_is_fully_durable,
    admin_node_shows_the_sync_in_force,
);

/// A SQLite url's own `?synchronous=`, from before the key, is applied as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_urls_own_synchronous_is_applied_as_written() {
    let db = Db::new(Backend::Sqlite).await;
    for (query, sync, setting) in [
        ("?synchronous=normal", Durability::Normal, "synchronous=NORMAL"),
        ("?synchronous=extra", Durability::Full, "synchronous=EXTRA"),
    ] {
        let opened = store::open(&format!("{}{query}", db.url)).await.unwrap();
        assert_eq!(opened.durability(), DurabilityInForce { sync, setting: setting.into() }, "{query}");
    }
}

/// `idem check` on `text`: its exit status, stdout and stderr.
fn idem_check(text: &str) -> (bool, String, String) {
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("idem.toml");
    std::fs::write(&file, text).unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_idem")).args(["check", "--config", file.to_str().unwrap()]).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn idem_check_shows_the_sync_in_force_and_refuses_a_bad_one_by_its_key() {
    let config = |url: &str, lines: &str| TestConfig::new("http://127.0.0.1:9000").store(url).store_lines(lines).text();
    for (url, lines, shown) in [
        ("sqlite://idem.db", "sync = \"normal\"", "store sync    normal"),
        ("sqlite://idem.db", "", "store sync    full"),
        ("sqlite://idem.db?synchronous=normal", "", "store sync    normal"),
        ("postgres://idem@db.internal/idem", "", "store sync    full"),
    ] {
        let (ok, stdout, stderr) = idem_check(&config(url, lines));
        assert!(ok, "{url} {lines:?}: {stderr}");
        assert!(stdout.contains(shown), "{url} {lines:?}: {stdout}");
    }
    for (url, lines) in [
        ("sqlite://idem.db", "sync = \"fast\""),
        ("sqlite://idem.db", "sync = 1"),
        ("sqlite://idem.db?synchronous=full", "sync = \"normal\""),
        ("postgres://idem@db.internal/idem", "sync = \"normal\""),
    ] {
        let (ok, _, stderr) = idem_check(&config(url, lines));
        assert!(!ok && stderr.contains("store.sync"), "{url} {lines:?}: {stderr}");
    }
    // What `normal` would lose on PostgreSQL is said.
    let (_, _, stderr) = idem_check(&config("postgres://idem@db.internal/idem", "sync = \"normal\""));
    assert!(stderr.contains("crash of the database server") && stderr.contains("OOM killer"), "{stderr}");
}
