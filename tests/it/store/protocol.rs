//! The store's protocol (docs/operations.md#upgrading): nodes sharing a store must mean the same
//! by its guards. A node of an older protocol still running is refused at its next write, loudly;
//! a node started against a store of a later protocol refuses to run; `idem migrate --status`
//! tells which upgrades roll node by node and which need every node stopped. Each on both stores.

use std::path::Path;
use std::time::Duration;

use crate::common::{both_stores, Backend, Db};
use idem::domain::{RecordId, Timestamp};
use idem::store::protocol::{Upgrade, STORE_PROTOCOL};
use sqlx::Connection;

/// A record for the old node to write to, made by a node of this build.
async fn a_record(db: &Db) -> RecordId {
    let store = db.store().await;
    let new = idem::store::NewRecord {
        id: RecordId::new(),
        tenant: "default".into(),
        key: idem::domain::key::IdempotencyKey::parse("k").unwrap(),
        route: "payments".into(),
        method: http::Method::POST,
        path: "/payments".into(),
        query: String::new(),
        fingerprint: idem::domain::fingerprint::Fingerprint::of("payments", "POST", "/payments", "", None, b"{}"),
        request: idem::record::StoredRequest { headers: vec![], body: bytes::Bytes::new() },
        deadline_at: Timestamp::now(),
        now: Timestamp::now(),
        policy_version: None,
        claim: None,
        tombstone_cutoff: None,
    };
    let admitted = store.admit(idem::store::Admit { new, retention_cutoff: Timestamp::EPOCH }).await.unwrap();
    let idem::store::Admission::Created(record) = admitted else { panic!("a new key is created") };
    record.id
}

fn sqlite_path(db: &Db) -> &str {
    db.url.strip_prefix("sqlite://").expect("a sqlite url")
}

/// The previous protocol's claim, as a node of it sends it: guarded by the token, setting the
/// lease in its own clock.
const OLD_CLAIM: &str = "UPDATE records SET state = 'in_progress', queued = FALSE, lease_owner = 'old-node',
    lease_expires_at = 1, updated_at = 1, claim_token = claim_token + 1
    WHERE id = $1 AND state = 'not_started' AND queued";

async fn a_node_of_an_older_protocol_is_refused_at_its_next_write(b: Backend) {
    let db = Db::new(b).await;
    let id = a_record(&db).await;
    match b {
        Backend::Sqlite => {
            // An older build's writing connection declares no protocol at all.
            let old = rusqlite::Connection::open(sqlite_path(&db)).unwrap();
            let sql = OLD_CLAIM.replace("$1", "?1").replace("FALSE", "0");
            let refused = old.execute(&sql, [id.to_string()]).unwrap_err().to_string();
            assert!(refused.contains("no such function: idem_store_protocol"), "{refused}");
            // A build of another protocol is refused by name.
            old.create_scalar_function(
                "idem_store_protocol",
                0,
                rusqlite::functions::FunctionFlags::SQLITE_UTF8,
                |_| Ok(STORE_PROTOCOL - 1),
            )
            .unwrap();
            let refused = old.execute(&sql, [id.to_string()]).unwrap_err().to_string();
            assert!(refused.contains(&format!("does not speak store protocol {STORE_PROTOCOL}")), "{refused}");
        }
        Backend::Postgres => {
            let mut old = sqlx::PgConnection::connect(&db.url).await.unwrap();
            let sql = OLD_CLAIM.replace("$1", "$1::uuid");
            let refused = sqlx::query(&sql).bind(id.to_string()).execute(&mut old).await.unwrap_err().to_string();
            assert!(refused.contains("speaks store protocol 1 or older"), "{refused}");
            sqlx::query("SET idem.protocol = '1'").execute(&mut old).await.unwrap();
            let refused = sqlx::query(&sql).bind(id.to_string()).execute(&mut old).await.unwrap_err().to_string();
            assert!(refused.contains("this node speaks store protocol 1"), "{refused}");
            // The name-guarded outcome writes kept for nodes of earlier versions are gone.
            let gone = sqlx::query(
                "SELECT * FROM idem_end_attempts(ARRAY[$1::uuid], ARRAY['old-node'], ARRAY[NULL]::jsonb[],
                     ARRAY['done'], ARRAY[NULL], ARRAY[NULL]::int4[], ARRAY[NULL]::jsonb[], ARRAY[NULL]::bytea[],
                     ARRAY[1::int8], ARRAY[FALSE], ARRAY[NULL]::int8[], ARRAY[NULL]::jsonb[])",
            )
            .bind(id.to_string())
            .execute(&mut old)
            .await
            .unwrap_err()
            .to_string();
            assert!(gone.contains("does not exist"), "{gone}");
        }
    }
    let untouched = db.store().await.get(id).await.unwrap().unwrap();
    assert_eq!(untouched.claim.0, 0, "nothing the old node wrote landed");
}

async fn a_store_of_a_later_protocol_is_refused_at_start_and_the_status_says_why(b: Backend) {
    let db = Db::new(b).await;
    a_record(&db).await;
    let later = STORE_PROTOCOL + 1;
    let bump = format!("UPDATE idem_store SET protocol = {later}");
    match b {
        Backend::Sqlite => {
            rusqlite::Connection::open(sqlite_path(&db)).unwrap().execute(&bump, []).unwrap();
        }
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query(&bump).execute(&mut conn).await.unwrap();
        }
    }
    let Err(refused) = idem::store::open(&db.url).await else { panic!("a store of a later protocol was opened") };
    let refused = refused.to_string();
    assert!(refused.contains(&format!("the store speaks protocol {later}")), "{refused}");
    let status = idem::store::status(&db.url).await.unwrap();
    assert_eq!(status.upgrade(), Upgrade::BuildBehind { store: later });
    assert!(status.to_string().contains(&format!("run a build that speaks protocol {later}")), "{status}");
}

/// A record as a node of the previous protocol leaves it: `state`, with a lease until
/// `lease_until` and a bound at `bound` (ms since the epoch), attempt 1 in flight when in
/// progress.
async fn an_old_record(db: &Db, b: Backend, key: &str, state: &str, lease_until: i64, bound: i64) -> RecordId {
    let id = RecordId::new();
    let in_flight = if state == "in_progress" { "1" } else { "NULL" };
    let sql = format!(
        "INSERT INTO records (id, tenant, key, route, method, path, query, fingerprint, request_headers,
             request_body, state, queued, deadline_at, created_at, updated_at, lease_owner, lease_expires_at,
             in_flight_number, in_flight_started_at, claim_token, in_flight_until)
         VALUES ('{id}', 'default', '{key}', 'payments', 'POST', '/payments', '', {digest}, '[]', {blob}, '{state}',
             {no}, 1, 1, 1, 'old-node', {lease_until}, {in_flight}, 1, 1, {bound})",
        digest = if b == Backend::Sqlite { "zeroblob(32)" } else { "decode(repeat('00', 32), 'hex')" },
        blob = if b == Backend::Sqlite { "X''" } else { "''::bytea" },
        no = if b == Backend::Sqlite { "0" } else { "FALSE" },
    );
    match b {
        Backend::Sqlite => {
            let old = rusqlite::Connection::open(sqlite_path(db)).unwrap();
            old.create_scalar_function(
                "idem_store_protocol",
                0,
                rusqlite::functions::FunctionFlags::SQLITE_UTF8,
                |_| Ok(STORE_PROTOCOL - 1),
            )
            .unwrap();
            old.execute(&sql, []).unwrap();
        }
        Backend::Postgres => {
            let mut old = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query(&format!("SET idem.protocol = '{}'", STORE_PROTOCOL - 1)).execute(&mut old).await.unwrap();
            sqlx::query(&sql.replace(&format!("'{id}'"), &format!("'{id}'::uuid"))).execute(&mut old).await.unwrap();
        }
    }
    id
}

/// A store at the previous protocol (the migrations of the previous build). The status says the
/// upgrade moves it on and needs every node stopped; a node of this build refuses to serve it
/// and names `idem migrate`; the migration refuses while a lease of the previous protocol is live,
/// naming it, and once none is, moves the store on and raises the bounds the previous protocol
/// may have cut short (an ambiguous answer brought them down to its own time) to at least the
/// longest reach from now.
async fn a_store_of_the_previous_protocol_is_migrated_explicitly_once_its_leases_end(b: Backend) {
    let db = Db::new(b).await;
    let (folder, last) = match b {
        Backend::Sqlite => ("sqlite", 11),
        Backend::Postgres => ("postgres", 13),
    };
    let previous = tempfile::TempDir::new().unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations").join(folder);
    for file in std::fs::read_dir(&dir).unwrap() {
        let file = file.unwrap();
        let version: i64 = file.file_name().to_string_lossy()[..4].parse().unwrap();
        if version <= last {
            std::fs::copy(file.path(), previous.path().join(file.file_name())).unwrap();
        }
    }
    let migrator = sqlx::migrate::Migrator::new(previous.path()).await.unwrap();
    match b {
        Backend::Sqlite => {
            let options = sqlx::sqlite::SqliteConnectOptions::new().filename(sqlite_path(&db)).create_if_missing(true);
            let mut conn = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
            migrator.run(&mut conn).await.unwrap();
        }
        Backend::Postgres => {
            let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
            migrator.run(&mut conn).await.unwrap();
        }
    }
    let status = idem::store::status(&db.url).await.unwrap();
    assert_eq!(status.upgrade(), Upgrade::StopEveryNode { from: STORE_PROTOCOL - 1, to: STORE_PROTOCOL });
    assert!(status.to_string().contains("stop every node first"), "{status}");
    let Err(refused) = idem::store::open(&db.url).await else {
        panic!("a node served a store of the previous protocol")
    };
    assert!(refused.to_string().contains("run `idem migrate`"), "{refused}");

    let now = Timestamp::now().as_millis();
    let live = an_old_record(&db, b, "live", "in_progress", now + 60_000, now + 1_000).await;
    let cut = an_old_record(&db, b, "cut", "unknown", 0, now - 1_000).await;
    let reach = Duration::from_secs(30);
    let refused = idem::store::migrate(&db.url, reach).await.unwrap_err().to_string();
    assert!(refused.contains(&format!("record {live} held by old-node")), "{refused}");
    assert_eq!(idem::store::status(&db.url).await.unwrap().store, Some(STORE_PROTOCOL - 1), "nothing migrated");

    // Its node stopped and its lease ran out: the migration goes ahead.
    let expire = format!("UPDATE records SET lease_expires_at = {} WHERE key = 'live'", now - 1);
    match b {
        Backend::Sqlite => {
            let old = rusqlite::Connection::open(sqlite_path(&db)).unwrap();
            old.create_scalar_function(
                "idem_store_protocol",
                0,
                rusqlite::functions::FunctionFlags::SQLITE_UTF8,
                |_| Ok(STORE_PROTOCOL - 1),
            )
            .unwrap();
            old.execute(&expire, []).unwrap();
        }
        Backend::Postgres => {
            let mut old = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query(&format!("SET idem.protocol = '{}'", STORE_PROTOCOL - 1)).execute(&mut old).await.unwrap();
            sqlx::query(&expire).execute(&mut old).await.unwrap();
        }
    }
    idem::store::migrate(&db.url, reach).await.unwrap();
    let status = idem::store::status(&db.url).await.unwrap();
    assert_eq!((status.store, status.upgrade()), (Some(STORE_PROTOCOL), Upgrade::UpToDate), "{status}");
    let store = db.store().await;
    for id in [live, cut] {
        let bound = store.get(id).await.unwrap().unwrap().in_flight_until.unwrap();
        assert!(bound.as_millis() >= now + reach.as_millis() as i64, "{id}: the bound raised to the reach from now");
    }
}

/// `idem migrate --status` prints the same, for an operator, and changes nothing.
#[tokio::test]
async fn idem_migrate_status_tells_an_empty_store_from_a_current_one_and_changes_nothing() {
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join("idem.db");
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nurl = \"sqlite://{}\"\n[[routes]]\nname = \"p\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n",
            db.display()
        ),
    )
    .unwrap();
    let migrate = |status: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        command.arg("migrate").arg("--config").arg(&config);
        if status {
            command.arg("--status");
        }
        let out = command.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let empty = migrate(true);
    assert!(empty.contains("store protocol   none") && empty.contains("upgrade          empty"), "{empty}");
    assert!(!db.exists(), "--status creates nothing");
    migrate(false);
    let current = migrate(true);
    assert!(current.contains(&format!("store protocol   {STORE_PROTOCOL}")), "{current}");
    assert!(current.contains("up to date"), "{current}");
}

both_stores!(
    a_node_of_an_older_protocol_is_refused_at_its_next_write,
    a_store_of_a_later_protocol_is_refused_at_start_and_the_status_says_why,
    a_store_of_the_previous_protocol_is_migrated_explicitly_once_its_leases_end,
);
