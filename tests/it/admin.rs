//! The operator's side (docs/operations.md): the admin API and the `idem requests` CLI over it.

use crate::common::{both_stores, setup, Backend};

use std::time::{Duration, Instant};

use crate::common::{send, Answer, Broker, Db, Reply, TestConfig, Upstream};
use serde_json::{json, Value};

const BODY: &str = r#"{"amount":42}"#;

/// How long after its mark a 504's attempt may still reach the upstream (its bound), on the
/// routes of [`setup_short`]: `send_window` + `per_try_timeout` + `clock_margin`.
const BOUND: Duration = Duration::from_millis(50 + 500 + 50);

/// A broker whose attempts have a short bound ([`BOUND`]), so that an operator's "not executed"
/// or retry, refused while a 504's attempt may still reach the upstream, can be seen applied
/// once it cannot.
async fn setup_short(b: Backend, tables: &str) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let tables = format!("[routes.retry]\nper_try_timeout = \"500ms\"\nmin_try = \"10ms\"\n{tables}");
    let config =
        TestConfig::new(&upstream.url()).worker("send_window = \"50ms\"\nclock_margin = \"50ms\"").tables(&tables);
    let broker = Broker::start(&Db::new(b).await, config).await;
    (upstream, broker)
}

/// Makes `key` unknown: the upstream answers 504 (ambiguous) on a route that is not replay-safe.
async fn unknown(upstream: &Upstream, broker: &Broker, key: &str) -> String {
    upstream.script(key, vec![Reply::status(504)]);
    send(broker.post("/payments", key, BODY)).await.assert_problem(502, "outcome-unknown");
    broker.record_json(key).await["id"].as_str().unwrap().to_string()
}

async fn admin_post(broker: &Broker, path: &str, body: Value) -> Answer {
    send(broker.http.post(format!("{}{}", broker.admin, path)).json(&body)).await
}

async fn admin_get(broker: &Broker, path: &str) -> Answer {
    send(broker.http.get(format!("{}{}", broker.admin, path))).await
}

async fn the_reconciliation_queue_lists_unknown_records_with_cursor_paging(b: Backend) {
    // Five ambiguous answers in a row would open the default circuit; this test needs it closed.
    let (upstream, broker) = setup(b, "", "[routes.circuit]\nfailures = 100\n").await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(unknown(&upstream, &broker, &format!("u{i}")).await);
    }
    send(broker.post("/payments", "fine", BODY)).await;

    let mut seen = Vec::new();
    let mut path = "/admin/requests?state=unknown&limit=2".to_string();
    loop {
        let page = admin_get(&broker, &path).await;
        assert_eq!(page.status, 200);
        let v = page.json();
        for item in v["items"].as_array().unwrap() {
            assert_eq!(item["state"], "unknown");
            seen.push(item["id"].as_str().unwrap().to_string());
        }
        match v["next_cursor"].as_str() {
            Some(c) => path = format!("/admin/requests?state=unknown&limit=2&cursor={c}"),
            None => break,
        }
    }
    assert_eq!(seen, ids, "every unknown record once, oldest first");

    let all = admin_get(&broker, "/admin/requests?route=payments&tenant=default").await.json();
    assert_eq!(all["items"].as_array().unwrap().len(), 6, "{all:#}");
    let none = admin_get(&broker, "/admin/requests?tenant=nobody").await.json();
    assert!(none["items"].as_array().unwrap().is_empty());
    admin_get(&broker, "/admin/requests?state=bogus").await.assert_problem(400, "invalid-filter");
    admin_get(&broker, "/admin/requests?cursor=nonsense").await.assert_problem(400, "invalid-cursor");
}

async fn resolving_executed_makes_duplicates_replay_the_operators_response(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let id = unknown(&upstream, &broker, "settle-me").await;
    let body = json!({
        "outcome": "executed",
        "response": {"status": 201, "headers": {"content-type": "application/json", "x-settled": ["by", "hand"]},
                     "body": "{\"id\":\"pay_1\"}"},
        "actor": "alice",
        "note": "found pay_1 in the provider dashboard"
    });
    let r = admin_post(&broker, &format!("/admin/requests/{id}/resolve"), body).await;
    assert_eq!(r.status, 200);
    let record = r.json();
    assert_eq!(record["state"], "done");
    let last = record["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["actor"], "alice");
    assert_eq!(last["action"], "resolve executed");
    assert_eq!(last["note"], "found pay_1 in the provider dashboard");
    assert!(last["at"].as_str().is_some());

    let dup = send(broker.post("/payments", "settle-me", BODY)).await;
    assert_eq!(dup.status, 201);
    assert_eq!(&dup.body[..], b"{\"id\":\"pay_1\"}");
    assert_eq!(dup.header("idempotent-replayed"), Some("true"));
    assert_eq!(dup.headers.get_all("x-settled").iter().count(), 2);
    assert_eq!(upstream.hits("settle-me"), 1);
}

/// An operator's "not executed" frees the key, once the 504's attempt can no longer reach the
/// upstream: before that, it is refused, saying for how long (the service behind a gateway may
/// still execute it).
async fn resolving_not_executed_frees_the_key_for_a_fresh_execution(b: Backend) {
    let (upstream, broker) = setup_short(b, "").await;
    let id = unknown(&upstream, &broker, "free-me").await;
    // The attempt was marked before its answer came: its bound has passed once this has.
    let answered = Instant::now();
    let path = format!("/admin/requests/{id}/resolve");
    let early = admin_post(&broker, &path, json!({"outcome": "not_executed"})).await;
    early.assert_problem(409, "attempt-in-flight");
    assert!(early.header("retry-after").is_some(), "says when to come back");
    tokio::time::sleep_until((answered + BOUND).into()).await;
    let r = admin_post(&broker, &path, json!({"outcome": "not_executed"})).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.json()["state"], "not_started");
    let again = send(broker.post("/payments", "free-me", BODY)).await;
    assert_eq!(again.status, 201);
    assert!(again.header("idempotent-replayed").is_none());
    assert_eq!(upstream.hits("free-me"), 2);
}

/// An operator's retry re-drives an `unknown` record, once its attempt can no longer reach the
/// upstream; before that it is refused.
async fn an_operator_retry_redrives_an_unknown_record(b: Backend) {
    let (upstream, broker) = setup_short(b, "").await;
    let id = unknown(&upstream, &broker, "again").await;
    let answered = Instant::now();
    let path = format!("/admin/requests/{id}/retry");
    admin_post(&broker, &path, json!({})).await.assert_problem(409, "attempt-in-flight");
    tokio::time::sleep_until((answered + BOUND).into()).await;
    let r = admin_post(&broker, &path, json!({"note": "provider confirmed no charge"})).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    let record = broker.await_record("again", std::time::Duration::from_secs(10), |v| v["state"] == "done").await;
    assert_eq!(record["response"]["status"], 201);
    assert_eq!(upstream.hits("again"), 2);
    let history = record["history"].as_array().unwrap();
    assert!(history.iter().any(|h| h["action"] == "retry" && h["note"] == "provider confirmed no charge"));
}

async fn actions_on_records_that_are_not_unknown_are_refused_clearly(b: Backend) {
    let (_upstream, broker) = setup(b, "", "").await;
    send(broker.post("/payments", "finished", BODY)).await;
    let id = broker.record_json("finished").await["id"].as_str().unwrap().to_string();
    let executed = json!({"outcome": "executed", "response": {"status": 200, "body": "x"}});
    let r = admin_post(&broker, &format!("/admin/requests/{id}/resolve"), executed).await;
    r.assert_problem(409, "invalid-transition");
    assert!(r.json()["detail"].as_str().unwrap().contains("done"));
    admin_post(&broker, &format!("/admin/requests/{id}/retry"), json!({}))
        .await
        .assert_problem(409, "invalid-transition");
    admin_post(&broker, &format!("/admin/requests/{id}/cancel"), json!({}))
        .await
        .assert_problem(409, "request-not-cancellable");
    // The record is untouched.
    assert_eq!(broker.record_json("finished").await["state"], "done");
}

async fn malformed_operator_input_gets_a_clear_error_and_changes_nothing(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let id = unknown(&upstream, &broker, "careful").await;
    let resolve = format!("/admin/requests/{id}/resolve");
    for (body, name) in [
        (json!({"outcome": "maybe"}), "invalid-resolution"),
        (json!({"outcome": "executed"}), "invalid-resolution"),
        (json!({"outcome": "executed", "response": {"status": 42}}), "invalid-resolution"),
        (
            json!({"outcome": "executed", "response": {"status": 200, "headers": {"bad header": "x"}}}),
            "invalid-resolution",
        ),
        (json!({"outcome": "executed", "response": {"status": 200, "body_base64": "***"}}), "invalid-resolution"),
        (json!({"outcome": "not_executed", "response": {"status": 200}}), "invalid-resolution"),
        (json!(["not", "an", "object"]), "invalid-body"),
    ] {
        admin_post(&broker, &resolve, body).await.assert_problem(400, name);
    }
    let r = send(broker.http.post(format!("{}{}", broker.admin, resolve)).body("{not json")).await;
    r.assert_problem(400, "invalid-body");
    admin_get(&broker, "/admin/requests/not-a-uuid").await.assert_problem(400, "invalid-id");
    admin_get(&broker, &format!("/admin/requests/{}", uuid::Uuid::new_v4()))
        .await
        .assert_problem(404, "request-not-found");
    assert_eq!(broker.record_json("careful").await["state"], "unknown");
}

async fn the_admin_api_requires_its_token_when_one_is_configured(b: Backend) {
    std::env::set_var("IDEM_TEST_ADMIN_TOKEN_A", "op-secret");
    let (_upstream, broker) = setup(b, "", "[auth]\nadmin_token_env = \"IDEM_TEST_ADMIN_TOKEN_A\"\n").await;
    let list = format!("{}/admin/requests", broker.admin);
    send(broker.http.get(&list)).await.assert_problem(401, "unauthorized");
    send(broker.http.get(&list).bearer_auth("wrong")).await.assert_problem(401, "unauthorized");
    assert_eq!(send(broker.http.get(&list).bearer_auth("op-secret")).await.status, 200);
    // Probes for orchestrators need no token.
    assert_eq!(send(broker.http.get(format!("{}/healthz", broker.admin))).await.status, 200);
    assert_eq!(send(broker.http.get(format!("{}/readyz", broker.admin))).await.status, 200);
}

fn cli(broker: &Broker, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("requests")
        .args(args)
        .args(["--admin", &broker.admin, "--actor", "bob"])
        .env_remove("IDEM_ADMIN_TOKEN")
        .output()
        .unwrap()
}

async fn the_cli_lists_shows_and_settles_the_queue(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let id = unknown(&upstream, &broker, "cli-key").await;

    let out = tokio::task::block_in_place(|| cli(&broker, &["list", "--state", "unknown"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("ID") && lines[0].contains("STATE"), "{table}");
    assert!(lines[1].contains(&id) && lines[1].contains("unknown") && lines[1].contains("cli-key"), "{table}");

    let out = tokio::task::block_in_place(|| cli(&broker, &["show", &id, "--json"]));
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["id"], id.as_str());

    let out = tokio::task::block_in_place(|| {
        cli(
            &broker,
            &[
                "resolve",
                &id,
                "--executed",
                "--status",
                "201",
                "--header",
                "content-type: application/json",
                "--body",
                "{\"ok\":true}",
                "--note",
                "seen upstream",
            ],
        )
    });
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("state     done") && text.contains("bob") && text.contains("seen upstream"), "{text}");
    let dup = send(broker.post("/payments", "cli-key", BODY)).await;
    assert_eq!(&dup.body[..], b"{\"ok\":true}");

    // A refused action is an error exit with the API's explanation.
    let out = tokio::task::block_in_place(|| cli(&broker, &["retry", &id]));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Only an unknown record"));
}

async fn a_bulk_action_is_planned_then_applied_to_each_record_with_its_own_history(b: Backend) {
    let (upstream, broker) = setup_short(b, "[routes.circuit]\nfailures = 100\n").await;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(unknown(&upstream, &broker, &format!("bulk{i}")).await);
    }
    // Every 504's attempt past its bound: "not executed" may be said of them all.
    let answered = Instant::now();
    send(broker.post("/payments", "bulk-done", BODY)).await;

    let filter = json!({"state": "unknown", "route": "payments", "tenant": "default"});
    let plan = admin_post(
        &broker,
        "/admin/requests/bulk",
        json!({"filter": filter, "action": "resolve_not_executed", "dry_run": true}),
    )
    .await;
    assert_eq!(plan.status, 200, "{:?}", plan.body);
    let plan = plan.json();
    assert_eq!(plan["count"], 4, "{plan:#}");
    let sampled: Vec<&str> = plan["sample"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(sampled, ids.iter().map(String::as_str).collect::<Vec<_>>());
    for i in 0..4 {
        assert_eq!(broker.record_json(&format!("bulk{i}")).await["state"], "unknown", "a dry run changes nothing");
    }

    // The CLI's dry run says the same.
    let out = tokio::task::block_in_place(|| {
        cli(
            &broker,
            &["bulk", "--state", "unknown", "--route", "payments", "--action", "resolve-not-executed", "--dry-run"],
        )
    });
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("4 record(s) match") && text.contains(&ids[0]), "{text}");

    // A window of creation times that ends before the first record matches nothing.
    let early = json!({"state": "unknown", "created_before": "2000-01-01T00:00:00Z"});
    let none =
        admin_post(&broker, "/admin/requests/bulk", json!({"filter": early, "action": "retry", "dry_run": true}));
    assert_eq!(none.await.json()["count"], 0);

    tokio::time::sleep_until((answered + BOUND).into()).await;
    let applied = admin_post(
        &broker,
        "/admin/requests/bulk",
        json!({"filter": filter, "action": "resolve_not_executed", "actor": "carol", "note": "provider outage, none charged"}),
    )
    .await;
    assert_eq!(applied.status, 200, "{:?}", applied.body);
    let applied = applied.json();
    assert_eq!(applied["applied"], 4, "{applied:#}");
    assert!(applied["refused"].as_array().unwrap().is_empty());
    for (i, id) in ids.iter().enumerate() {
        let record = broker.record_json(&format!("bulk{i}")).await;
        assert_eq!(record["state"], "not_started");
        let history = admin_get(&broker, &format!("/admin/requests/{id}")).await.json()["history"].clone();
        let entries: Vec<&Value> = history.as_array().unwrap().iter().filter(|h| h["actor"] == "carol").collect();
        assert_eq!(entries.len(), 1, "{history:#}");
        assert_eq!(entries[0]["action"], "resolve not_executed");
        assert_eq!(entries[0]["note"], "provider outage, none charged");
    }
    // Freed: the same request executes afresh.
    assert_eq!(send(broker.post("/payments", "bulk0", BODY)).await.status, 201);
    assert_eq!(upstream.hits("bulk0"), 2);
    assert_eq!(broker.record_json("bulk-done").await["state"], "done");

    // Nothing left to act on; a record that is not unknown is refused on its own.
    let again = admin_post(&broker, "/admin/requests/bulk", json!({"filter": filter, "action": "retry"})).await.json();
    assert_eq!((again["matched"].clone(), again["applied"].clone()), (json!(0), json!(0)), "{again:#}");
    let done = json!({"state": "done"});
    let refused = admin_post(&broker, "/admin/requests/bulk", json!({"filter": done, "action": "retry"})).await.json();
    assert_eq!(refused["applied"], 0, "{refused:#}");
    assert!(refused["refused"][0]["reason"].as_str().unwrap().contains("Only an unknown record"), "{refused:#}");
}

async fn a_bulk_cancel_stops_every_matching_execution_before_its_next_attempt(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nbase = \"5s\"\ncap = \"5s\"\njitter = \"none\"\n").await;
    let keys = ["halt0", "halt1", "halt2"];
    for key in keys {
        upstream.script(key, vec![Reply::status(503)]);
        let r = send(broker.post("/payments", key, BODY).header("prefer", "respond-async")).await;
        assert_eq!(r.status, 202);
    }
    send(broker.post("/payments", "finished", BODY)).await;
    // Each first attempt failed with 503; the workers now wait 5 s before the next.
    for key in keys {
        broker
            .await_record(key, Duration::from_secs(5), |v| v["attempts"].as_array().is_some_and(|a| a.len() == 1))
            .await;
    }

    let started = Instant::now();
    let filter = json!({"state": "in_progress", "route": "payments"});
    let applied = admin_post(
        &broker,
        "/admin/requests/bulk",
        json!({"filter": filter, "action": "cancel", "actor": "dana", "note": "provider asked us to stop"}),
    )
    .await;
    assert_eq!(applied.status, 200, "{:?}", applied.body);
    let applied = applied.json();
    assert_eq!((applied["matched"].clone(), applied["applied"].clone()), (json!(3), json!(3)), "{applied:#}");
    for key in keys {
        let record = broker.await_record(key, Duration::from_secs(3), |v| v["state"] == "not_started").await;
        assert_eq!(record["stop_reason"], "cancelled", "{record:#}");
        let id = record["id"].as_str().unwrap();
        let history = admin_get(&broker, &format!("/admin/requests/{id}")).await.json()["history"].clone();
        let entries: Vec<&Value> = history.as_array().unwrap().iter().filter(|h| h["actor"] == "dana").collect();
        assert_eq!(entries.len(), 1, "{history:#}");
        assert_eq!(
            (entries[0]["action"].as_str(), entries[0]["note"].as_str()),
            (Some("cancel"), Some("provider asked us to stop"))
        );
        assert_eq!(upstream.hits(key), 1, "{key} was sent again after its cancel");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "the waits were not cut short");
    assert_eq!(
        broker.record_json("finished").await["state"],
        "done",
        "a record the filter does not match is left alone"
    );
}

async fn bad_bulk_requests_are_refused_naming_the_field(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    unknown(&upstream, &broker, "stays").await;
    for (body, name, field) in [
        (json!({"action": "retry"}), "invalid-filter", "filter"),
        (json!({"filter": {"state": "lost"}, "action": "retry"}), "invalid-filter", "filter.state"),
        (
            json!({"filter": {"state": "unknown", "created_after": "noon"}, "action": "retry"}),
            "invalid-filter",
            "created_after",
        ),
        (json!({"filter": {"state": "unknown"}, "action": "explode"}), "invalid-action", "action"),
        (json!({"filter": {"state": "unknown"}, "action": "retry", "limit": 0}), "invalid-limit", "limit"),
        (json!({"filter": {"state": "unknown", "routes": "x"}, "action": "retry"}), "invalid-body", "routes"),
    ] {
        let r = admin_post(&broker, "/admin/requests/bulk", body.clone()).await;
        r.assert_problem(400, name);
        assert!(r.json()["detail"].as_str().unwrap().contains(field), "{body}: {:?}", r.body);
    }
    assert_eq!(broker.record_json("stays").await["state"], "unknown");
}

both_stores!(
    a_bulk_action_is_planned_then_applied_to_each_record_with_its_own_history,
    a_bulk_cancel_stops_every_matching_execution_before_its_next_attempt,
    bad_bulk_requests_are_refused_naming_the_field,
    the_reconciliation_queue_lists_unknown_records_with_cursor_paging,
    resolving_executed_makes_duplicates_replay_the_operators_response,
    resolving_not_executed_frees_the_key_for_a_fresh_execution,
    an_operator_retry_redrives_an_unknown_record,
    actions_on_records_that_are_not_unknown_are_refused_clearly,
    malformed_operator_input_gets_a_clear_error_and_changes_nothing,
    the_admin_api_requires_its_token_when_one_is_configured,
    the_cli_lists_shows_and_settles_the_queue,
);
