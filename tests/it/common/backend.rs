//! The two store backends, each giving a test an empty database of its own: SQLite in a
//! temporary directory, PostgreSQL as a fresh database on the server named by
//! `IDEM_TEST_POSTGRES_URL` (e.g. `postgres://postgres@127.0.0.1:55432/postgres`, as
//! `.ci/start-postgres` prints). Without that variable PostgreSQL tests are skipped, except
//! under CI, where a skipped backend would hide a failure.

use sqlx::{Connection, PgConnection};
use uuid::Uuid;

pub const POSTGRES_URL_VAR: &str = "IDEM_TEST_POSTGRES_URL";
/// The certificate of the authority that issued the server's (for `localhost`), for the tests
/// of the store over TLS; `.ci/start-postgres` makes it.
pub const POSTGRES_CA_VAR: &str = "IDEM_TEST_POSTGRES_CA";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The PostgreSQL server to test against, if one is configured. Panics under CI (`CI` set) when
/// none is: there the PostgreSQL tests must run.
pub fn postgres_server_url() -> Option<String> {
    match std::env::var(POSTGRES_URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => panic!(
            "{POSTGRES_URL_VAR} is not set under CI: the PostgreSQL tests must run \
             (start a server with .ci/start-postgres)"
        ),
        _ => None,
    }
}

/// The authority of the server's certificate, if one is given. Panics under CI when none is:
/// there the TLS tests must run.
pub fn postgres_ca() -> Option<std::path::PathBuf> {
    match std::env::var(POSTGRES_CA_VAR) {
        Ok(path) if !path.is_empty() => Some(path.into()),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{POSTGRES_CA_VAR} is not set under CI: the store's TLS tests must run (see .ci/start-postgres)")
        }
        _ => None,
    }
}

/// Says that a PostgreSQL test did not run, and why. Written straight to stderr: the test
/// harness would swallow a `println!` of a test that passes.
pub fn skipped(test: &str) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "skipped {test}: set {POSTGRES_URL_VAR} (and, for the TLS tests, {POSTGRES_CA_VAR}) to run it against PostgreSQL"
    );
}

/// The URL of a new, empty database `idem_t_<uuid>` on the configured server, or `None` when
/// no server is configured (see [`postgres_server_url`]). For black-box tests that start a
/// broker on PostgreSQL: put it in the broker's `[store] url`.
pub async fn postgres_url_for_new_db() -> Option<String> {
    let server = postgres_server_url()?;
    let name = format!("idem_t_{}", Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(&server).await.unwrap_or_else(|e| panic!("cannot connect to {server}: {e}"));
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));
    let _ = admin.close().await;
    Some(with_database(&server, &name))
}

/// Drops a database made by [`postgres_url_for_new_db`], ending its open connections first.
/// Best effort: a leftover database costs disk, not correctness.
pub async fn drop_postgres_db(url: &str) {
    let (Some(server), Some(name)) = (postgres_server_url(), database_name(url)) else {
        return;
    };
    if !name.starts_with("idem_t_") {
        return;
    }
    if let Ok(mut admin) = PgConnection::connect(&server).await {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut admin).await;
        let _ = admin.close().await;
    }
}

/// `server` with its database replaced by `name`; user, host, port and options are kept.
pub fn with_database(server: &str, name: &str) -> String {
    let mut url =
        reqwest::Url::parse(server).unwrap_or_else(|e| panic!("{POSTGRES_URL_VAR} is not a URL ({e}): {server}"));
    url.set_path(&format!("/{name}"));
    url.to_string()
}

fn database_name(url: &str) -> Option<String> {
    let url = reqwest::Url::parse(url).ok()?;
    Some(url.path().trim_start_matches('/').to_string())
}
