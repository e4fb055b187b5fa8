//! Emergency switches (docs/operations.md): `retries_off` and `isolate` set through `/admin/switches` and
//! `idem switch`, obeyed by the data plane, ended by a clear or an expiry, audited, kept across a
//! restart. Every case runs on SQLite and PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use idem::domain::clock::ManualClock;

use crate::common::{both_stores, send, Answer, Backend, Broker, Db, Gate, Reply, TestConfig, Upstream};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

const BODY: &str = r#"{"amount":42}"#;
/// Retries come quickly: a test that sees one does not wait for it.
const QUICK_RETRIES: &str = "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n";

async fn setup(b: Backend, extra: &str) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let broker = Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).tables(extra)).await;
    (upstream, broker)
}

async fn admin_post(broker: &Broker, path: &str, body: Value) -> Answer {
    send(broker.http.post(format!("{}{}", broker.admin, path)).json(&body)).await
}

async fn admin_get(broker: &Broker, path: &str) -> Answer {
    send(broker.http.get(format!("{}{}", broker.admin, path))).await
}

/// Sets a switch and returns it as the API answered.
async fn set(broker: &Broker, body: Value) -> Value {
    let r = admin_post(broker, "/admin/switches", body).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    r.json()
}

async fn clear(broker: &Broker, id: &str, actor: &str, reason: &str) -> Answer {
    admin_post(broker, &format!("/admin/switches/{id}/clear"), json!({"actor": actor, "reason": reason})).await
}

async fn active(broker: &Broker) -> Vec<Value> {
    let r = admin_get(broker, "/admin/switches").await;
    assert_eq!(r.status, 200);
    r.json()["items"].as_array().unwrap().clone()
}

/// A request whose first attempt gets 503 and whose second would get 201.
async fn first_attempt_503(upstream: &Upstream, broker: &Broker, key: &str) -> Answer {
    upstream.script(key, vec![Reply::status(503), Reply::status(201)]);
    send(broker.post("/payments", key, BODY)).await
}

async fn retries_off_lets_only_first_attempts_out_until_it_is_cleared(b: Backend) {
    let (upstream, broker) = setup(b, QUICK_RETRIES).await;
    let switch = set(
        &broker,
        json!({"scope": "payments", "action": "retries_off", "reason": "PSP is drowning", "actor": "alice"}),
    )
    .await;
    assert_eq!((switch["scope"].as_str(), switch["action"].as_str()), (Some("payments"), Some("retries_off")));
    assert_eq!((switch["status"].as_str(), switch["actor"].as_str()), (Some("active"), Some("alice")));

    let answer = first_attempt_503(&upstream, &broker, "no-retry").await;
    assert_eq!(answer.status, 503, "the upstream's own answer, relayed");
    assert_eq!(upstream.hits("no-retry"), 1, "no retry was started");
    let record = broker.record_json("no-retry").await;
    assert_eq!(record["stop_reason"], "retries_off", "{record:#}");
    assert_eq!(record["attempts"].as_array().unwrap().len(), 1);

    let r = clear(&broker, switch["id"].as_str().unwrap(), "bob", "PSP recovered").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["status"], "cleared");
    let answer = first_attempt_503(&upstream, &broker, "retried").await;
    assert_eq!(answer.status, 201);
    assert_eq!(upstream.hits("retried"), 2, "retried again once the switch is off");
}

async fn an_isolated_route_refuses_new_keys_but_replays_done_ones(b: Backend) {
    let (upstream, broker) = setup(b, "").await;
    let before = send(broker.post("/payments", "paid-before", BODY)).await;
    assert_eq!(before.status, 201);

    set(&broker, json!({"scope": "all", "action": "isolate", "reason": "upstream is melting"})).await;
    let refused = send(broker.post("/payments", "new-key", BODY)).await;
    refused.assert_problem(503, "circuit-open");
    assert_eq!(refused.header("x-should-retry"), Some("true"));
    assert!(refused.header("retry-after").is_some());
    assert_eq!(upstream.hits("new-key"), 0, "nothing reached the upstream");
    // Nothing was recorded either: the key is free once the switch is cleared.
    assert_eq!(broker.record("new-key").await.status(), 404);
    // Unkeyed traffic on the route is held back too.
    send(broker.http.get(format!("{}/payments/status", broker.url))).await.assert_problem(503, "circuit-open");
    assert!(upstream.received().iter().all(|r| !r.starts_with("GET")), "{:?}", upstream.received());

    let replay = send(broker.post("/payments", "paid-before", BODY)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, before.body);
    assert_eq!(upstream.hits("paid-before"), 1);
}

/// On a route with one place (`max_concurrency = 1`): request `ahead` holds it at the upstream
/// for 3 s, time enough for a test to set things up, and request `queued` is admitted and waits
/// behind it.
async fn one_ahead_and_one_queued(
    upstream: &Upstream,
    broker: &Broker,
) -> (Gate, JoinHandle<Answer>, JoinHandle<Answer>) {
    // The upstream holds the first request until the test opens the gate.
    let gate = Gate::closed();
    upstream.script("ahead", vec![Reply::status(201).held_by(&gate)]);
    let ahead = tokio::spawn(send(broker.post("/payments", "ahead", BODY)));
    // The one place on the route is taken once the upstream holds the first request.
    upstream.await_hits("ahead", 1).await;
    let queued = tokio::spawn(send(broker.post("/payments", "queued", BODY)));
    let recorded = async {
        while broker.record("queued").await.status() != 200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), recorded).await.expect("queued was not recorded within 10 s");
    (gate, ahead, queued)
}

/// A request admitted before the isolation and still queued when it is set gets the same answer
/// as one refused at admission: nothing is sent, the key is free.
async fn a_request_queued_before_an_isolation_gets_circuit_open_and_its_key_stays_free(b: Backend) {
    let upstream = Upstream::start().await;
    let broker = Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).route("max_concurrency = 1")).await;
    let (gate, ahead, queued) = one_ahead_and_one_queued(&upstream, &broker).await;

    set(&broker, json!({"scope": "payments", "action": "isolate", "reason": "upstream is melting"})).await;
    gate.open();
    assert_eq!(ahead.await.unwrap().status, 201, "the attempt in flight ends normally");
    let queued = queued.await.unwrap();
    queued.assert_problem(503, "circuit-open");
    assert_eq!(queued.header("x-should-retry"), Some("true"));
    assert_eq!(queued.header("idempotency-status"), Some("not_started"));
    assert_eq!(upstream.hits("queued"), 0, "nothing reached the upstream");
    let record = broker.record_json("queued").await;
    assert_eq!((record["state"].as_str(), record["queued"].as_bool()), (Some("not_started"), Some(false)));
    assert_eq!(record["stop_reason"], "circuit_open");
}

/// A duplicate waiting on a queued request that an isolation frees is answered from the record,
/// not by the execution: with the same problem as the request itself.
async fn a_duplicate_waiting_on_a_request_an_isolation_frees_gets_circuit_open_too(b: Backend) {
    // A route of this test's own: the metrics are the process's, and no other test waits on it.
    let route = format!("isolated-{b:?}");
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let config = TestConfig::new(&upstream.url())
        .store(&db.url)
        .route("max_concurrency = 1")
        .text()
        .replace("\"payments\"", &format!("\"{route}\""));
    let broker = Broker::start_with(&db, config).await;
    let (gate, ahead, queued) = one_ahead_and_one_queued(&upstream, &broker).await;
    let duplicate = tokio::spawn(send(broker.post("/payments", "queued", BODY).header("prefer", "wait=10")));
    broker.await_metric(&format!("idem_waiting_requests{{route=\"{route}\"}} 1")).await;

    set(&broker, json!({"scope": route, "action": "isolate", "reason": "upstream is melting"})).await;
    gate.open();
    assert_eq!(ahead.await.unwrap().status, 201);
    queued.await.unwrap().assert_problem(503, "circuit-open");
    let duplicate = duplicate.await.unwrap();
    duplicate.assert_problem(503, "circuit-open");
    assert_eq!(duplicate.header("idempotency-status"), Some("not_started"));
    assert_eq!(upstream.hits("queued"), 0, "nothing reached the upstream");
}

async fn a_switch_ends_by_itself_when_it_expires(b: Backend) {
    // Half an hour passes on the broker's clock, which the test moves, not on the wall's.
    let upstream = Upstream::start().await;
    let clock = Arc::new(ManualClock::starting_now());
    let broker = Broker::start_with_clock(
        &Db::new(b).await,
        TestConfig::new(&upstream.url()).tables(QUICK_RETRIES),
        clock.clone(),
    )
    .await;
    let switch =
        set(&broker, json!({"scope": "payments", "action": "retries_off", "reason": "brief", "expires_in": "30m"}))
            .await;
    let set_at = humantime::parse_rfc3339(switch["set_at"].as_str().unwrap()).unwrap();
    let expires_at = humantime::parse_rfc3339(switch["expires_at"].as_str().unwrap()).unwrap();
    assert_eq!(expires_at.duration_since(set_at).unwrap(), Duration::from_secs(1_800));
    clock.advance(Duration::from_secs(1_799));
    assert_eq!(active(&broker).await.len(), 1, "on until its expiry");

    // Past its expiry, everything sees it ended, though nobody cleared it.
    clock.advance(Duration::from_secs(1));
    assert!(active(&broker).await.is_empty(), "the switch outlived its expiry");
    let answer = first_attempt_503(&upstream, &broker, "after-expiry").await;
    assert_eq!(answer.status, 201);
    assert_eq!(upstream.hits("after-expiry"), 2);
    let history = admin_get(&broker, "/admin/switches?history=true").await.json();
    assert_eq!(history["items"][0]["status"], "expired", "{history:#}");
    // An expired switch is not active: there is nothing to clear.
    clear(&broker, switch["id"].as_str().unwrap(), "bob", "late").await.assert_problem(409, "switch-not-active");
}

async fn bad_switch_requests_are_refused_naming_the_field(b: Backend) {
    let (_upstream, broker) = setup(b, "").await;
    let good = json!({"scope": "payments", "action": "retries_off", "reason": "why", "expires_in": "30m"});
    for (field, value, problem_field) in [
        ("scope", json!("orders"), "scope"),
        ("scope", json!(null), "scope"),
        ("action", json!("retries_of"), "action"),
        ("reason", json!("   "), "reason"),
        ("reason", json!(null), "reason"),
        ("expires_in", json!("soon"), "expires_in"),
        ("expires_in", json!("0s"), "expires_in"),
    ] {
        let mut body = good.clone();
        body[field] = value.clone();
        let r = admin_post(&broker, "/admin/switches", body).await;
        r.assert_problem(422, "invalid-switch");
        assert_eq!(r.json()["field"], problem_field, "{field} = {value}");
        assert!(r.json()["detail"].as_str().unwrap().starts_with(problem_field));
    }
    let r = send(broker.http.post(format!("{}/admin/switches", broker.admin)).body("{not json")).await;
    r.assert_problem(400, "invalid-body");
    admin_post(&broker, "/admin/switches", json!({"scope": "payments", "colour": "red"}))
        .await
        .assert_problem(400, "invalid-body");
    admin_get(&broker, "/admin/switches?history=maybe").await.assert_problem(400, "invalid-filter");
    admin_get(&broker, "/admin/switches?history=true&limit=0").await.assert_problem(400, "invalid-limit");
    assert!(active(&broker).await.is_empty(), "nothing was set");

    let id = set(&broker, good).await["id"].as_str().unwrap().to_string();
    let r = admin_post(&broker, &format!("/admin/switches/{id}/clear"), json!({"actor": "bob"})).await;
    r.assert_problem(422, "invalid-switch");
    assert_eq!(r.json()["field"], "reason");
    clear(&broker, &uuid::Uuid::new_v4().to_string(), "bob", "x").await.assert_problem(404, "switch-not-found");
    clear(&broker, "nope", "bob", "x").await.assert_problem(400, "invalid-id");
    assert_eq!(clear(&broker, &id, "bob", "done").await.status, 200);
    clear(&broker, &id, "bob", "again").await.assert_problem(409, "switch-not-active");
}

async fn a_switch_survives_a_restart(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).tables(QUICK_RETRIES)).await;
    set(&broker, json!({"scope": "payments", "action": "retries_off", "reason": "over the weekend"})).await;
    broker.stop().await;

    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).tables(QUICK_RETRIES)).await;
    let on = active(&broker).await;
    assert_eq!(on.len(), 1);
    assert_eq!(on[0]["reason"], "over the weekend");
    // Obeyed from the first request after the restart.
    let answer = first_attempt_503(&upstream, &broker, "after-restart").await;
    assert_eq!(answer.status, 503);
    assert_eq!(upstream.hits("after-restart"), 1);
    broker.stop().await;
}

async fn the_audit_trail_keeps_who_set_replaced_and_cleared_each_switch_and_why(b: Backend) {
    let (_upstream, broker) = setup(b, "").await;
    let first =
        set(&broker, json!({"scope": "payments", "action": "isolate", "reason": "first", "actor": "alice"})).await;
    let second =
        set(&broker, json!({"scope": "payments", "action": "isolate", "reason": "longer", "actor": "bob"})).await;
    assert_eq!(second["replaced"]["id"], first["id"], "setting it again replaces the active one");
    assert_eq!(active(&broker).await.len(), 1);
    let r = clear(&broker, second["id"].as_str().unwrap(), "carol", "upstream is back").await;
    assert_eq!(r.status, 200);
    assert!(active(&broker).await.is_empty());

    let history = admin_get(&broker, "/admin/switches?history=true").await.json();
    let items = history["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{history:#}");
    let (newest, oldest) = (&items[0], &items[1]);
    assert_eq!(newest["id"], second["id"]);
    assert_eq!((newest["actor"].as_str(), newest["reason"].as_str()), (Some("bob"), Some("longer")));
    assert_eq!(newest["status"], "cleared");
    assert_eq!(newest["cleared"]["actor"], "carol");
    assert_eq!(newest["cleared"]["reason"], "upstream is back");
    assert!(newest["cleared"]["at"].as_str().is_some());
    assert_eq!(oldest["id"], first["id"]);
    assert_eq!((oldest["actor"].as_str(), oldest["reason"].as_str()), (Some("alice"), Some("first")));
    assert_eq!(oldest["status"], "replaced");
    assert_eq!(oldest["cleared"]["actor"], "bob");
    assert_eq!(oldest["cleared"]["replaced_by"], second["id"]);
    let limited = admin_get(&broker, "/admin/switches?history=true&limit=1").await.json();
    assert_eq!(limited["items"].as_array().unwrap().len(), 1);
}

async fn the_switches_need_the_admin_token_when_one_is_configured(b: Backend) {
    std::env::set_var("IDEM_TEST_ADMIN_TOKEN_S", "op-secret");
    let (_upstream, broker) = setup(b, "[auth]\nadmin_token_env = \"IDEM_TEST_ADMIN_TOKEN_S\"\n").await;
    let url = format!("{}/admin/switches", broker.admin);
    let body = json!({"scope": "all", "action": "retries_off", "reason": "x"});
    send(broker.http.post(&url).json(&body)).await.assert_problem(401, "unauthorized");
    send(broker.http.get(&url)).await.assert_problem(401, "unauthorized");
    assert_eq!(send(broker.http.post(&url).json(&body).bearer_auth("op-secret")).await.status, 201);
}

fn cli(broker: &Broker, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("switch")
        .args(args)
        .args(["--admin", &broker.admin, "--actor", "dana"])
        .env_remove("IDEM_ADMIN_TOKEN")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

async fn the_cli_sets_lists_and_clears_switches(b: Backend) {
    let (_upstream, broker) = setup(b, "").await;
    let run = |args: &'static [&'static str]| tokio::task::block_in_place(|| cli(&broker, args));

    let (ok, out, err) = run(&[
        "set",
        "--scope",
        "payments",
        "--action",
        "retries_off",
        "--reason",
        "retry storm",
        "--expires-in",
        "30m",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("active") && out.contains("retries_off") && out.contains("retry storm"), "{out}");
    let on = active(&broker).await;
    assert_eq!(on.len(), 1);
    assert_eq!(on[0]["actor"], "dana");

    let (ok, out, _) = run(&["list"]);
    assert!(ok && out.contains(on[0]["id"].as_str().unwrap()) && out.contains("payments"), "{out}");
    let (ok, out, _) = run(&["list", "--json"]);
    assert!(ok);
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["items"][0]["id"], on[0]["id"]);

    let (ok, _, err) = run(&["set", "--scope", "orders", "--action", "isolate", "--reason", "x"]);
    assert!(!ok && err.contains("scope"), "{err}");

    let (ok, out, err) = run(&["clear", "--scope", "payments", "--action", "retries_off", "--reason", "storm is over"]);
    assert!(ok, "{err}");
    assert!(out.contains("cleared") && out.contains("storm is over"), "{out}");
    assert!(active(&broker).await.is_empty());
    let (ok, _, err) = run(&["clear", "--scope", "payments", "--action", "retries_off", "--reason", "again"]);
    assert!(!ok && err.contains("no retries_off switch is active"), "{err}");

    let (ok, out, _) = run(&["list", "--history"]);
    assert!(ok && out.contains("cleared") && out.contains("dana") && out.contains("retry storm"), "{out}");
}

async fn the_switch_metric_is_one_while_a_switch_is_on(b: Backend) {
    let (_upstream, broker) = setup(b, "").await;
    let metrics = || async { send(broker.http.get(format!("{}/metrics", broker.admin))).await };
    let line = "idem_switch_active{scope=\"payments\",action=\"isolate\"}";
    let text = String::from_utf8(metrics().await.body.to_vec()).unwrap();
    assert!(text.contains("# TYPE idem_switch_active gauge") && text.contains(&format!("{line} 0")), "{text}");
    let id = set(&broker, json!({"scope": "payments", "action": "isolate", "reason": "x"})).await["id"].clone();
    let text = String::from_utf8(metrics().await.body.to_vec()).unwrap();
    assert!(text.contains(&format!("{line} 1")), "{text}");
    assert_eq!(clear(&broker, id.as_str().unwrap(), "bob", "over").await.status, 200);
    let text = String::from_utf8(metrics().await.body.to_vec()).unwrap();
    assert!(text.contains(&format!("{line} 0")), "{text}");
}

both_stores!(
    retries_off_lets_only_first_attempts_out_until_it_is_cleared,
    an_isolated_route_refuses_new_keys_but_replays_done_ones,
    a_request_queued_before_an_isolation_gets_circuit_open_and_its_key_stays_free,
    a_duplicate_waiting_on_a_request_an_isolation_frees_gets_circuit_open_too,
    a_switch_ends_by_itself_when_it_expires,
    bad_switch_requests_are_refused_naming_the_field,
    a_switch_survives_a_restart,
    the_audit_trail_keeps_who_set_replaced_and_cleared_each_switch_and_why,
    the_switches_need_the_admin_token_when_one_is_configured,
    the_cli_sets_lists_and_clears_switches,
    the_switch_metric_is_one_while_a_switch_is_on,
);
