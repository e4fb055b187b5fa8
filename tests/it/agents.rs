//! docs/agents.md: agents retry late and without keys. Keys derived from what names the operation,
//! fingerprints that ignore what changes on every retry, key lifetimes a client can see, answers
//! it can act on, waiting without polling, and results that outlive retention as tombstones.

use crate::common::JsonOf;

use crate::common::{both_stores, send, setup, Backend, Broker, Db, TestConfig, Upstream};

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use idem::domain::clock::ManualClock;

use serde_json::{json, Value};

const TOOLS: &str = r#"key_from = ["header:x-agent-run", "json:/tool", "json:/arguments"]
fingerprint_ignore = ["/call_id", "/arguments/requested_at", "/metadata/nonce"]"#;

fn tool_call(broker: &Broker, run: &str, body: Value) -> reqwest::RequestBuilder {
    broker.http.post(format!("{}/payments", broker.url)).header("x-agent-run", run).json(&body)
}

async fn a_key_is_derived_from_the_run_the_tool_and_its_arguments(b: Backend) {
    let (upstream, broker) = setup(b, TOOLS, "").await;
    let first = json!({"tool": "refund", "arguments": {"order": 7, "amount": 5}, "call_id": "c1"});
    let r = send(tool_call(&broker, "run-1", first)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let key = r.header("idempotency-key").expect("the derived key is echoed").to_string();
    assert!(key.starts_with("derived:") && key.len() == 8 + 64, "{key}");
    // The model minted a new call id and re-serialised the arguments: the same operation.
    let again = json!({"call_id": "c2", "arguments": {"amount": 5, "order": 7}, "tool": "refund"});
    let r = send(tool_call(&broker, "run-1", again)).await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
    // Another run, or other arguments, are other operations.
    let r = send(tool_call(&broker, "run-2", json!({"tool": "refund", "arguments": {"order": 7, "amount": 5}}))).await;
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_ne!(r.header("idempotency-key"), Some(key.as_str()));
    let r = send(tool_call(&broker, "run-1", json!({"tool": "refund", "arguments": {"order": 8, "amount": 5}}))).await;
    assert_eq!(r.header("idempotent-replayed"), None);
    assert_eq!(upstream.received().len(), 3);
    // The record is there under the derived key.
    assert_eq!(broker.record_json(&key).await["state"], "done");
}

async fn a_missing_key_source_is_named_and_nothing_is_sent(b: Backend) {
    let (upstream, broker) = setup(b, TOOLS, "").await;
    let r = send(broker.http.post(format!("{}/payments", broker.url)).json(&json!({"tool": "refund"}))).await;
    r.assert_problem(400, "missing-idempotency-key");
    assert!(r.json()["detail"].as_str().unwrap().contains("header:x-agent-run"), "{}", r.json());
    let r = send(tool_call(&broker, "run-1", json!({"tool": "refund"}))).await;
    r.assert_problem(400, "missing-idempotency-key");
    assert!(r.json()["detail"].as_str().unwrap().contains("json:/arguments"), "{}", r.json());
    assert!(upstream.received().is_empty());
    // A key of the client's own still wins.
    let r = send(broker.post("/payments", "own-key", r#"{"tool":"x"}"#)).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotency-key"), Some("own-key"));
}

async fn an_ignored_field_that_changed_is_a_replay_not_a_422(b: Backend) {
    let (upstream, broker) = setup(b, TOOLS, "").await;
    let call = |at: &str, nonce: &str| json!({"tool": "refund", "arguments": {"order": 7, "requested_at": at}, "metadata": {"nonce": nonce, "v": 1}});
    let first = send(tool_call(&broker, "run-1", call("10:00", "a"))).await;
    assert_eq!(first.status, 201);
    // Derived without the timestamp: the agent's retry with a fresh one is the same operation.
    let key = first.header("idempotency-key").unwrap().to_string();
    let r = send(tool_call(&broker, "run-1", call("10:07", "c"))).await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
    // The same holds under the client's own key: the fingerprint ignores them too.
    let r = send(
        broker.http.post(format!("{}/payments", broker.url)).header("idempotency-key", &key).json(&call("10:05", "b")),
    )
    .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(r.body, first.body);
    // A field that is not ignored still makes another request.
    let mut other = call("10:05", "b");
    other["metadata"]["v"] = json!(2);
    let r =
        send(broker.http.post(format!("{}/payments", broker.url)).header("idempotency-key", &key).json(&other)).await;
    r.assert_problem(422, "idempotency-key-reused");
    assert_eq!(upstream.received().len(), 1);
}

async fn every_keyed_answer_says_until_when_its_key_is_replayed(b: Backend) {
    let (_upstream, broker) = setup(b, "retention = \"2h\"", "").await;
    let before = SystemTime::now();
    let r = send(broker.post("/payments", "expiring", "{}")).await;
    let expires = httpdate::parse_http_date(r.header("idempotency-key-expires").expect("on the first answer")).unwrap();
    let two_hours = Duration::from_secs(7200);
    assert!(expires + Duration::from_secs(2) >= before + two_hours, "{expires:?}");
    assert!(expires <= SystemTime::now() + two_hours + Duration::from_secs(1), "{expires:?}");
    let replay = send(broker.post("/payments", "expiring", "{}")).await;
    assert!(replay.header("idempotency-key-expires").is_some());
    let refused = send(broker.post("/payments", "expiring", r#"{"other":1}"#)).await;
    assert!(refused.header("idempotency-key-expires").is_some());
}

async fn the_routes_say_how_keys_work(b: Backend) {
    let (_upstream, broker) =
        setup(b, &format!("{TOOLS}\nretention = \"72h\"\ntombstone = \"0s\"\nmax_body = \"64KiB\""), "").await;
    let routes: Value = broker.http.get(format!("{}/_idem/routes", broker.url)).json_of().await;
    let route = &routes["routes"][0];
    assert_eq!(route["name"], "payments");
    assert_eq!(route["path_prefix"], "/payments");
    assert_eq!(route["keyed_methods"], json!(["POST", "PATCH"]));
    assert_eq!(route["replay_safe"], false);
    assert_eq!(route["retention_seconds"], 72 * 3600);
    assert_eq!(route["tombstone_seconds"], 0);
    assert_eq!(route["max_body"], 64 * 1024);
    assert_eq!(route["key_from"], json!(["header:x-agent-run", "json:/tool", "json:/arguments"]));
    assert_eq!(route["fingerprint_ignore"], json!(["/call_id", "/arguments/requested_at", "/metadata/nonce"]));
}

async fn a_problem_names_its_key_its_record_and_whether_to_retry(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    upstream.script("unsure", vec![crate::common::Reply::status(504)]);
    let r = send(broker.post("/payments", "unsure", "{}")).await;
    r.assert_problem(502, "outcome-unknown");
    let p = r.json();
    assert_eq!(p["idempotency_key"], "unsure", "{p}");
    assert_eq!(p["record"], "/_idem/requests/unsure", "{p}");
    assert_eq!(p["retryable"], false, "{p}");
    let polled = broker.http.get(format!("{}{}", broker.url, p["record"].as_str().unwrap())).send().await.unwrap();
    assert_eq!(polled.status(), 200);
}

async fn a_record_can_be_awaited_instead_of_polled(b: Backend) {
    let (_upstream, broker) = setup(b, "", "").await;
    let slow = broker.post("/payments?delay_ms=600", "awaited", "{}").header("prefer", "respond-async");
    assert_eq!(send(slow).await.status, 202);
    let asked = Instant::now();
    let record: Value =
        broker.http.get(format!("{}/_idem/requests/awaited", broker.url)).header("prefer", "wait=10").json_of().await;
    assert_eq!(record["state"], "done", "{record:#}");
    assert!(asked.elapsed() < Duration::from_secs(5), "waited {:?}", asked.elapsed());
    // Without the preference, the answer is immediate.
    let now: Value = broker.http.get(format!("{}/_idem/requests/awaited", broker.url)).json_of().await;
    assert_eq!(now["state"], "done");
}

/// A broker whose time only moves when the test moves it: a retention or a tombstone is
/// passed at once instead of slept through.
async fn setup_on_clock(b: Backend, route_extra: &str) -> (Upstream, Broker, Arc<ManualClock>) {
    let upstream = Upstream::start().await;
    let clock = Arc::new(ManualClock::starting_now());
    let broker =
        Broker::start_with_clock(&Db::new(b).await, TestConfig::new(&upstream.url()).route(route_extra), clock.clone())
            .await;
    (upstream, broker, clock)
}

/// Moves the broker's time past a done record's retention of one second.
fn past_retention(clock: &ManualClock) {
    clock.advance(Duration::from_millis(1_300));
}

/// Waits for the retention sweep (which runs every second) to have made `key`'s record a tombstone.
async fn await_tombstone(broker: &Broker) {
    let url = format!("{}/admin/requests?state=done", broker.admin);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let listed: Value = broker.http.get(&url).json_of().await;
        if listed["items"][0]["tombstone_until"].is_string() {
            return;
        }
        assert!(Instant::now() < until, "the sweep never made a tombstone: {listed:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn a_late_retry_within_the_tombstone_is_refused_and_never_executed(b: Backend) {
    let (upstream, broker, clock) = setup_on_clock(b, "retention = \"1s\"\ntombstone = \"30d\"").await;
    let first = send(broker.post("/payments", "late", r#"{"amount":5}"#)).await;
    assert_eq!(first.status, 201);
    past_retention(&clock);
    // Past its retention, whether the sweep has made it a tombstone yet or not.
    for swept in [false, true] {
        if swept {
            await_tombstone(&broker).await;
        }
        let r = send(broker.post("/payments", "late", r#"{"amount":5}"#)).await;
        r.assert_problem(410, "result-expired");
        let p = r.json();
        assert_eq!(p["original_status"], 201, "{p}");
        assert!(p["completed_at"].as_str().is_some_and(|t| t.starts_with("20")), "{p}");
        assert_eq!(p["retryable"], false);
        assert_eq!(r.header("x-should-retry"), Some("false"));
    }
    assert_eq!(upstream.hits("late"), 1, "a spent key was executed again");
    // Another body under the reused key is a new operation.
    let r = send(broker.post("/payments", "late", r#"{"amount":6}"#)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(upstream.hits("late"), 2);
}

async fn after_the_tombstone_or_without_one_the_same_request_executes_again(b: Backend) {
    let (upstream, broker, clock) = setup_on_clock(b, "retention = \"1s\"\ntombstone = \"1s\"").await;
    send(broker.post("/payments", "old", "{}")).await;
    clock.advance(Duration::from_millis(2_300));
    let r = send(broker.post("/payments", "old", "{}")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(upstream.hits("old"), 2);

    let (upstream, broker, clock) = setup_on_clock(b, "retention = \"1s\"\ntombstone = \"0s\"").await;
    send(broker.post("/payments", "untombed", "{}")).await;
    past_retention(&clock);
    let r = send(broker.post("/payments", "untombed", "{}")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(upstream.hits("untombed"), 2);
}

both_stores!(
    a_late_retry_within_the_tombstone_is_refused_and_never_executed,
    after_the_tombstone_or_without_one_the_same_request_executes_again,
    a_key_is_derived_from_the_run_the_tool_and_its_arguments,
    a_missing_key_source_is_named_and_nothing_is_sent,
    an_ignored_field_that_changed_is_a_replay_not_a_422,
    every_keyed_answer_says_until_when_its_key_is_replayed,
    the_routes_say_how_keys_work,
    a_problem_names_its_key_its_record_and_whether_to_retry,
    a_record_can_be_awaited_instead_of_polled,
);
