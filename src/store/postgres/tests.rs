//! Plans of the statements about one record, checked against a real PostgreSQL.

use super::leases::{ATTEMPT_STARTED, CLAIM, RENEW};
use super::outcomes::LATE_OUTCOME;
use super::upkeep::TAKE_OVER;
use super::*;

/// A store on a database of its own, made for one test and removed after it.
pub(super) struct Scratch {
    pub(super) store: PostgresStore,
    admin: PgPool,
    name: String,
}

impl Scratch {
    /// Drops the database, closing the store's connections first.
    pub(super) async fn remove(self) {
        drop(self.store);
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name)).execute(&self.admin).await.unwrap();
    }
}

/// A [`Scratch`] store named after `prefix`, on the server that `IDEM_TEST_POSTGRES_URL` names;
/// `None` (the test skipped) without one, except under CI.
pub(super) async fn scratch_store(prefix: &str) -> Option<Scratch> {
    scratch_store_synced(prefix, Durability::Full).await
}

/// A [`scratch_store`] whose sessions commit as `sync` says.
pub(super) async fn scratch_store_synced(prefix: &str, sync: Durability) -> Option<Scratch> {
    let server = match std::env::var("IDEM_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ if std::env::var_os("CI").is_some() => panic!("IDEM_TEST_POSTGRES_URL is not set under CI"),
        _ => {
            eprintln!("skipped: set IDEM_TEST_POSTGRES_URL to run it against PostgreSQL");
            return None;
        }
    };
    let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let admin = PgPool::connect(&server).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let mut url = url::Url::parse(&server).unwrap();
    url.set_path(&format!("/{name}"));
    let store = PostgresStore::open(url.as_str(), sync, LeaseClock::Database).await.unwrap();
    Some(Scratch { store, admin, name })
}

/// Every statement about one record (and `idem_end_attempts`) reaches it through the primary
/// key, even in the generic plan of a table without statistics yet: with `state = '…'`, the planner scanned
/// a partial index whole (every in-progress record's entry) and filtered on the id.
#[tokio::test]
async fn one_record_statements_go_through_the_primary_key() {
    let Some(scratch) = scratch_store("idem_plans").await else { return };
    let store = &scratch.store;

    let mut conn = store.pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await.unwrap();
    // Each statement with its parameters' types, as the store binds them.
    let statements = [
        (CLAIM, "text, text, int8, int8, text, int8"),
        (ATTEMPT_STARTED, "text, int8, int8, int8, int8, text, int8, int8"),
        (RENEW, "text, int8, int8, int8, int8"),
        (TAKE_OVER, "text, int8, int8, text, bool, text, text, text, int8, int8"),
        (LATE_OUTCOME, "text, int8, int8, text, text, int4, text, bytea, int8, text, text, int8"),
    ];
    for (i, (sql, types)) in statements.into_iter().enumerate() {
        sqlx::query(&format!("PREPARE statement_{i} ({types}) AS {sql}")).execute(&mut *conn).await.unwrap();
        let nulls = vec!["NULL"; types.split(',').count()].join(", ");
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN EXECUTE statement_{i}({nulls})")).fetch_all(&mut *conn).await.unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("Index Scan using records_pkey"), "{sql}\nis planned as\n{plan}");
    }

    // `idem_end_attempts` updates row by row inside PL/pgSQL, out of EXPLAIN's reach: count
    // the index scans its update makes within one transaction instead.
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(
        "SELECT * FROM idem_end_attempts(ARRAY[gen_random_uuid()], ARRAY[1::int8], ARRAY[NULL]::jsonb[],
             ARRAY[TRUE], ARRAY['done'], ARRAY[NULL], ARRAY[NULL]::int4[], ARRAY[NULL]::jsonb[],
             ARRAY[NULL]::bytea[], ARRAY[1::int8], ARRAY[NULL]::int8[], ARRAY[FALSE], ARRAY[NULL]::int8[],
             ARRAY[NULL]::jsonb[])",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let scans: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, pg_stat_get_xact_numscans(indexrelid)
         FROM pg_stat_user_indexes WHERE relname = 'records' AND pg_stat_get_xact_numscans(indexrelid) > 0",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ROLLBACK").execute(&mut *conn).await.unwrap();
    assert_eq!(scans, [("records_pkey".to_string(), 1)], "idem_end_attempts scanned these indexes");
    drop(conn);
    scratch.remove().await;
}

/// Every session of the store commits as the database does, `synchronous_commit` on: each of
/// the pool's connections, and the health checks' own. `normal` is refused, before anything is
/// opened: on PostgreSQL it would lose commits to any crash of the server.
#[tokio::test]
async fn every_session_commits_durably_and_normal_is_refused() {
    let refused = session("postgres://idem@127.0.0.1/idem", Durability::Normal).unwrap_err().to_string();
    assert!(refused.contains("for SQLite only"), "{refused}");
    for (sync, setting) in [(Durability::Full, "on")] {
        let Some(scratch) = scratch_store_synced("idem_sync", sync).await else { return };
        let store = &scratch.store;
        assert_eq!(store.durability().sync, sync);
        assert_eq!(store.durability().setting, format!("synchronous_commit={setting}"));
        let mut held = Vec::new();
        for _ in 0..3 {
            let mut conn = store.pool.acquire().await.unwrap();
            let shown: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *conn).await.unwrap();
            assert_eq!(shown, setting, "a pool connection of a store with sync {sync}");
            held.push(conn);
        }
        drop(held);
        store.ping().await.unwrap();
        let mut check = store.health_check.lock().await.take().expect("the health check keeps its connection");
        let shown: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut check).await.unwrap();
        assert_eq!(shown, setting, "the health check's connection of a store with sync {sync}");
        drop(check);
        scratch.remove().await;
    }
}

/// A primary replicating to no synchronous standby is warned about, naming the setting; one
/// with any synchronous standby named is not.
#[test]
fn a_primary_without_a_synchronous_standby_is_warned_about_naming_the_setting() {
    let replication =
        |names: &str| super::replication::Replication { synchronous_standby_names: names.into(), streaming: Some(1) };
    let warning = replication(" ").warning().expect("an empty setting is warned about");
    assert!(
        warning.contains("synchronous_standby_names is empty") && warning.contains("high-availability"),
        "{warning}"
    );
    assert_eq!(replication("*").warning(), None);
    assert_eq!(replication("FIRST 1 (standby1)").warning(), None);
}
