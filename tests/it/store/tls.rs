//! The PostgreSQL store over TLS, against the real server `.ci/start-postgres` runs with
//! `ssl = on` and a certificate for `localhost` from a private authority
//! (`IDEM_TEST_POSTGRES_CA`): `sslmode` and `sslrootcert` in the store URL, spelt as libpq
//! spells them.

use sqlx::{Connection, PgConnection};

use crate::common::backend::{self, Backend};
use crate::common::{send, Broker, Db, TestConfig, Upstream};

/// `db`'s URL, reached as `host`, with `params` as its query.
fn url_for(db: &Db, host: &str, params: &str) -> String {
    let mut url = reqwest::Url::parse(&db.url).unwrap();
    url.set_host(Some(host)).unwrap();
    url.set_query(Some(params));
    url.to_string()
}

/// The server and its authority's certificate, or the test is skipped.
fn server_and_authority(test: &str) -> Option<String> {
    backend::postgres_server_url()?;
    match backend::postgres_ca() {
        Some(ca) => Some(ca.display().to_string()),
        None => {
            backend::skipped(test);
            None
        }
    }
}

/// Whether every connection of the broker's to `db` (all but this test's own) speaks TLS; how
/// many there are.
async fn broker_connections(db: &Db) -> (i64, bool) {
    let mut watcher = PgConnection::connect(&db.url).await.unwrap();
    let (count, all_tls): (i64, Option<bool>) = sqlx::query_as(
        "SELECT count(*), bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()",
    )
    .fetch_one(&mut watcher)
    .await
    .unwrap();
    (count, all_tls.unwrap_or(false))
}

#[tokio::test]
async fn verify_full_with_the_authority_keeps_records_over_tls() {
    let Some(ca) = server_and_authority("store_tls::verify_full_with_the_authority_keeps_records_over_tls") else {
        return;
    };
    let (db, upstream) = (Db::new(Backend::Postgres).await, Upstream::start().await);
    let url = url_for(&db, "localhost", &format!("sslmode=verify-full&sslrootcert={ca}"));
    let broker = Broker::start_with(&db, TestConfig::new(&upstream.url()).store(&url).text()).await;
    let r = send(broker.post("/payments", "over-tls", r#"{"amount":1}"#)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(broker.record_json("over-tls").await["state"], "done");
    let (count, all_tls) = broker_connections(&db).await;
    assert!(count > 0 && all_tls, "{count} connections, all over TLS: {all_tls}");
    broker.stop().await;
}

#[tokio::test]
async fn verify_full_refuses_a_server_reached_by_a_name_its_certificate_does_not_carry() {
    let test = "store_tls::verify_full_refuses_a_server_reached_by_a_name_its_certificate_does_not_carry";
    let Some(ca) = server_and_authority(test) else { return };
    let db = Db::new(Backend::Postgres).await;
    // The certificate names `localhost`; 127.0.0.1 is the same server by another name.
    let url = url_for(&db, "127.0.0.1", &format!("sslmode=verify-full&sslrootcert={ca}"));
    let e = idem::store::open(&url).await.err().expect("a certificate for another name was accepted");
    let said = idem::observe::logs::in_one_line(&e);
    assert!(said.contains("certificate") && said.contains("127.0.0.1"), "{said}");
}

#[tokio::test]
async fn verify_ca_trusts_the_authority_it_is_given_and_no_other() {
    let test = "store_tls::verify_ca_trusts_the_authority_it_is_given_and_no_other";
    let Some(ca) = server_and_authority(test) else { return };
    let db = Db::new(Backend::Postgres).await;
    let url = url_for(&db, "localhost", "sslmode=verify-ca");
    let e = idem::store::open(&url).await.err().expect("a private authority was trusted without sslrootcert");
    let said = idem::observe::logs::in_one_line(&e);
    assert!(said.contains("certificate"), "{said}");
    let url = url_for(&db, "localhost", &format!("sslmode=verify-ca&sslrootcert={ca}"));
    if let Err(e) = idem::store::open(&url).await {
        panic!("verify-ca refused the server with its authority: {}", idem::observe::logs::in_one_line(&e));
    }
}

#[tokio::test]
async fn require_encrypts_without_checking_and_disable_does_not_encrypt() {
    let test = "store_tls::require_encrypts_without_checking_and_disable_does_not_encrypt";
    if server_and_authority(test).is_none() {
        return;
    }
    let upstream = Upstream::start().await;
    for (mode, tls) in [("require", true), ("disable", false)] {
        let db = Db::new(Backend::Postgres).await;
        let url = url_for(&db, "127.0.0.1", &format!("sslmode={mode}"));
        let broker = Broker::start_with(&db, TestConfig::new(&upstream.url()).store(&url).text()).await;
        assert_eq!(send(broker.post("/payments", mode, r#"{"amount":1}"#)).await.status, 201);
        let (count, all_tls) = broker_connections(&db).await;
        assert!(count > 0, "sslmode={mode}: no connection");
        assert_eq!(all_tls, tls, "sslmode={mode}");
        broker.stop().await;
    }
}
