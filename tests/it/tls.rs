//! TLS on every link but the store's (tests/it/store_tls.rs): the listeners with their
//! certificates, rotated by a reload; upstreams under a private authority, with a client
//! certificate and a server name; the operator CLI over https. Every handshake is real, every
//! certificate made here by a private authority.

use std::path::Path;

use serde_json::Value;
use tempfile::TempDir;

use crate::common::pki::{Authority, Issued};
use crate::common::{send, Backend, Broker, Db, TestConfig, Upstream};

const BODY: &str = r#"{"amount":100}"#;

/// `[server]` lines naming `issued`'s files, written to `dir`, for the listener `prefix` names
/// (`""` or `"admin_"`).
fn listener_lines(dir: &Path, prefix: &str, issued: &Issued) -> String {
    let (cert, key) = issued.write(dir, &format!("{prefix}listener"));
    format!("{prefix}tls_cert = {cert:?}\n{prefix}tls_key = {key:?}\n")
}

#[tokio::test]
async fn the_data_listener_speaks_tls_with_its_certificate_and_nothing_else() {
    let (ca, dir, upstream) = (Authority::new("listener authority"), TempDir::new().unwrap(), Upstream::start().await);
    let db = Db::new(Backend::Sqlite).await;
    let server = listener_lines(dir.path(), "", &ca.server(&["127.0.0.1"]));
    let mut broker = Broker::start(&db, TestConfig::new(&upstream.url()).server(&server)).await;
    assert!(broker.url.starts_with("https://"), "{}", broker.url);
    broker.http = ca.client_trusting();

    let r = send(broker.post("/payments", "over-tls", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    let replay = send(broker.post("/payments", "over-tls", BODY)).await;
    assert_eq!(replay.body, r.body, "a replay over TLS is the same bytes");
    assert_eq!(upstream.hits("over-tls"), 1);

    // Plain HTTP on the TLS port gets no answer, and a client that does not trust the authority
    // does not get through the handshake.
    let plain = reqwest::Client::new().post(broker.url.replace("https://", "http://") + "/payments");
    let plain = plain.header("idempotency-key", "plain").body(BODY).send().await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");
    let stranger = reqwest::Client::builder().no_proxy().build().unwrap();
    let refused = stranger.post(format!("{}/payments", broker.url)).body(BODY).send().await;
    let refused = refused.expect_err("a client that does not trust the certificate was answered");
    assert!(format!("{:?}", refused).to_lowercase().contains("certificate"), "{refused:?}");
    assert_eq!(upstream.hits("plain"), 0);
    // The admin listener has no certificate of its own: it stays plain.
    assert!(broker.admin.starts_with("http://"), "{}", broker.admin);
    let health = reqwest::get(format!("{}/healthz", broker.admin)).await.unwrap();
    assert_eq!(health.status(), 200);
    broker.stop().await;
}

#[tokio::test]
async fn the_admin_listener_takes_its_own_certificate_and_the_cli_trusts_it_with_ca_file() {
    let (data_ca, admin_ca) = (Authority::new("data authority"), Authority::new("admin authority"));
    let (dir, upstream) = (TempDir::new().unwrap(), Upstream::start().await);
    let db = Db::new(Backend::Sqlite).await;
    let server = listener_lines(dir.path(), "", &data_ca.server(&["127.0.0.1"]))
        + &listener_lines(dir.path(), "admin_", &admin_ca.server(&["127.0.0.1"]));
    let mut broker = Broker::start(&db, TestConfig::new(&upstream.url()).server(&server)).await;
    broker.http = data_ca.client_trusting();
    assert_eq!(send(broker.post("/payments", "admin-tls", BODY)).await.status, 201);

    let health = admin_ca.client_trusting().get(format!("{}/healthz", broker.admin)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let wrong = data_ca.client_trusting().get(format!("{}/healthz", broker.admin)).send().await;
    assert!(wrong.is_err(), "the admin listener presented the data listener's certificate");

    let list = idem::admin::cli::Command::List { state: None, route: None, tenant: None, limit: 10, cursor: None };
    let ca_file = admin_ca.write(dir.path(), "admin-ca");
    let cli = idem::admin::cli::Client::new(&broker.admin, None, "ops".into(), Some(&ca_file)).unwrap();
    let table = cli.run(list, false).await.unwrap();
    assert!(table.contains("admin-tls"), "{table}");
    let untrusting = idem::admin::cli::Client::new(&broker.admin, None, "ops".into(), None).unwrap();
    let list = idem::admin::cli::Command::List { state: None, route: None, tenant: None, limit: 10, cursor: None };
    let e = untrusting.run(list, false).await.expect_err("the CLI trusted a private authority it was not given");
    assert!(e.to_string().contains("certificate"), "the CLI's error does not say why: {e}");
    broker.stop().await;
}

#[tokio::test]
async fn a_reload_rotates_a_listeners_certificate_and_a_broken_one_is_refused_whole() {
    let (old_ca, new_ca) = (Authority::new("old authority"), Authority::new("new authority"));
    let (dir, upstream) = (TempDir::new().unwrap(), Upstream::start().await);
    let db = Db::new(Backend::Sqlite).await;
    let server = listener_lines(dir.path(), "", &old_ca.server(&["127.0.0.1"]));
    let mut broker = Broker::start(&db, TestConfig::new(&upstream.url()).server(&server)).await;
    broker.http = old_ca.client_trusting();
    assert_eq!(send(broker.post("/payments", "before", BODY)).await.status, 201);

    // Rotation rewrites the files in place; the config file itself does not change.
    new_ca.server(&["127.0.0.1"]).write(dir.path(), "listener");
    let applied = broker.reload(None).await;
    assert_eq!(applied.status, 200, "{applied:?}");
    let changes: Value = serde_json::from_slice(&applied.body).unwrap();
    assert!(changes.to_string().contains("server.tls_cert"), "the rotation is not reported: {changes}");
    let fresh = new_ca.client_trusting();
    let r = send(fresh.post(format!("{}/payments", broker.url)).header("idempotency-key", "after").body(BODY)).await;
    assert_eq!(r.status, 201, "the new certificate is not served");
    let stale = old_ca.client_trusting().post(format!("{}/payments", broker.url)).body(BODY).send().await;
    let stale = stale.expect_err("the old certificate is still served to a new connection");
    assert!(format!("{stale:?}").to_lowercase().contains("certificate"), "refused for another cause: {stale:?}");

    // A key that does not parse is refused, naming its key, and the certificate in force stays.
    std::fs::write(dir.path().join("listener.key"), "not a key").unwrap();
    let refused = broker.reload(None).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    let problem: Value = serde_json::from_slice(&refused.body).unwrap();
    assert!(problem.to_string().contains("server.tls_key"), "{problem}");
    // A new client: its first handshake is made after the refusal, not before it.
    let after = new_ca.client_trusting();
    let r = send(after.post(format!("{}/payments", broker.url)).header("idempotency-key", "kept").body(BODY)).await;
    assert_eq!(r.status, 201, "the certificate in force was dropped by a refused reload");
    broker.stop().await;
}

#[tokio::test]
async fn turning_a_listeners_tls_on_needs_a_restart() {
    let (ca, dir, upstream) = (Authority::new("authority"), TempDir::new().unwrap(), Upstream::start().await);
    let db = Db::new(Backend::Sqlite).await;
    let config = TestConfig::new(&upstream.url());
    let broker = Broker::start(&db, config.clone()).await;
    let server = listener_lines(dir.path(), "", &ca.server(&["127.0.0.1"]));
    let text = broker.config_text.replace("admin_listen", &format!("{server}admin_listen"));
    broker.write_config(&text);
    let refused = broker.reload(None).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    let problem: Value = serde_json::from_slice(&refused.body).unwrap();
    assert!(problem.to_string().contains("server.tls_cert") && problem.to_string().contains("restart"), "{problem}");
    assert_eq!(send(broker.post("/payments", "still-plain", BODY)).await.status, 201);
    broker.stop().await;
}

/// A TLS upstream whose certificate `ca` issued for 127.0.0.1, asking for a client certificate
/// issued by `clients` when given.
async fn tls_upstream(ca: &Authority, clients: Option<&Authority>) -> Upstream {
    Upstream::start_tls(ca.server(&["127.0.0.1"]).server_config(clients)).await
}

/// The route's lines for TLS towards its upstream.
fn route_tls(ca_file: Option<&Path>, client: Option<(&Path, &Path)>) -> String {
    let mut lines = String::new();
    if let Some(path) = ca_file {
        lines += &format!("ca_file = {path:?}\n");
    }
    if let Some((cert, key)) = client {
        lines += &format!("client_cert = {cert:?}\nclient_key = {key:?}\n");
    }
    lines
}

/// Starts a broker whose one route calls `upstream` with `route` among its lines, one attempt
/// per request: a refused handshake is answered at once.
async fn broker_for(db: &Db, upstream: &Upstream, route: &str) -> Broker {
    let config = TestConfig::new(&upstream.url()).route(route).tables("[routes.retry]\nmax_attempts = 1");
    Broker::start(db, config).await
}

#[tokio::test]
async fn an_upstream_under_a_private_authority_is_refused_without_ca_file_naming_the_route_and_the_cause() {
    let (ca, dir) = (Authority::new("upstream authority"), TempDir::new().unwrap());
    let upstream = tls_upstream(&ca, None).await;
    let db = Db::new(Backend::Sqlite).await;

    let broker = broker_for(&db, &upstream, &route_tls(None, None)).await;
    let r = send(broker.post("/payments", "untrusted", BODY)).await;
    assert_eq!(r.status, 503, "{r:?}");
    let problem: Value = serde_json::from_slice(&r.body).unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("route payments") && detail.contains("not from an authority the route trusts"), "{detail}");
    assert_eq!(upstream.hits("untrusted"), 0);
    // The client reads the kind of failure; the operator's view of the attempt keeps its cause.
    let record = broker.record_json("untrusted").await;
    assert!(record["attempts"][0].get("detail").is_none(), "the client's view shows the cause: {record:#}");
    let id = record["id"].as_str().unwrap();
    let admin: Value = send(broker.http.get(format!("{}/admin/requests/{id}", broker.admin))).await.json();
    let cause = admin["attempts"][0]["detail"].as_str().unwrap_or_default();
    assert!(cause.contains("route payments") && cause.contains("UnknownIssuer"), "{admin:#}");
    // A plain pass-through (no key) says the same.
    let passed = send(broker.http.get(format!("{}/payments/status", broker.url))).await;
    assert_eq!(passed.status, 503, "{passed:?}");
    assert!(String::from_utf8_lossy(&passed.body).contains("route payments"), "{passed:?}");
    broker.stop().await;

    let ca_file = ca.write(dir.path(), "upstream-ca");
    let broker = broker_for(&db, &upstream, &route_tls(Some(&ca_file), None)).await;
    let r = send(broker.post("/payments", "trusted", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(upstream.hits("trusted"), 1);
    let passed = send(broker.http.get(format!("{}/payments/status", broker.url))).await;
    assert_eq!(passed.status, 201, "{passed:?}");
    broker.stop().await;
}

#[tokio::test]
async fn an_upstream_that_asks_for_a_client_certificate_is_served_only_with_one() {
    let (ca, clients, dir) = (Authority::new("upstream authority"), Authority::new("clients"), TempDir::new().unwrap());
    let upstream = tls_upstream(&ca, Some(&clients)).await;
    let ca_file = ca.write(dir.path(), "upstream-ca");
    let db = Db::new(Backend::Sqlite).await;

    let broker = broker_for(&db, &upstream, &route_tls(Some(&ca_file), None)).await;
    let r = send(broker.post("/payments", "no-client-cert", BODY)).await;
    // Refused after the request was written (TLS 1.3), but by the handshake: nothing executed.
    assert_eq!(r.status, 503, "{r:?}");
    let problem: Value = serde_json::from_slice(&r.body).unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("route payments") && detail.contains("it refused the TLS handshake"), "{detail}");
    assert_eq!(upstream.hits("no-client-cert"), 0);
    broker.stop().await;

    let (cert, key) = clients.client("idem").write(dir.path(), "client");
    let broker = broker_for(&db, &upstream, &route_tls(Some(&ca_file), Some((&cert, &key)))).await;
    let r = send(broker.post("/payments", "with-client-cert", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(upstream.hits("with-client-cert"), 1);
    broker.stop().await;
}

#[tokio::test]
async fn server_name_checks_and_sends_a_name_other_than_the_urls_host() {
    let (ca, dir) = (Authority::new("upstream authority"), TempDir::new().unwrap());
    let upstream = Upstream::start_tls(ca.server(&["payments.internal"]).server_config(None)).await;
    let ca_file = ca.write(dir.path(), "upstream-ca");
    let db = Db::new(Backend::Sqlite).await;

    let broker = broker_for(&db, &upstream, &route_tls(Some(&ca_file), None)).await;
    let r = send(broker.post("/payments", "by-address", BODY)).await;
    assert_eq!(r.status, 503, "a certificate for another name was trusted: {r:?}");
    broker.stop().await;

    let route = format!("server_name = \"payments.internal\"\n{}", route_tls(Some(&ca_file), None));
    let broker = broker_for(&db, &upstream, &route).await;
    let r = send(broker.post("/payments", "by-name", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(upstream.hits("by-name"), 1);
    broker.stop().await;
}

#[tokio::test]
async fn a_named_upstream_lends_its_tls_to_every_route_that_names_it() {
    let (ca, dir) = (Authority::new("upstream authority"), TempDir::new().unwrap());
    let upstream = tls_upstream(&ca, None).await;
    let ca_file = ca.write(dir.path(), "upstream-ca");
    let db = Db::new(Backend::Sqlite).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n\
         [[upstreams]]\nname = \"bank\"\nurl = \"{}\"\nca_file = {ca_file:?}\n\
         [[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"bank\"\n",
        db.url,
        upstream.url()
    );
    let broker = Broker::start_with(&db, text).await;
    let r = send(broker.post("/payments", "via-named", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(upstream.hits("via-named"), 1);
    broker.stop().await;
}
