//! A real, widely used SDK through Idem, changed in nothing but its base URL: stripe-python,
//! which sends an `Idempotency-Key` and retries with it, in front of a fake authenticated API
//! that counts its side effects. A lost response, a 503 with Retry-After, twenty concurrent
//! duplicates and a reused key each end with exactly one side effect and the SDK's own object
//! (or an error the SDK reads, with Idem's code and message).
//!
//! The SDK comes from PyPI: `.ci/run` installs it in a virtual environment and names its
//! interpreter in `IDEM_TEST_PYTHON`. Elsewhere the test runs where `python3` has `stripe`,
//! and says it was skipped where it has not (under `CI` it fails instead).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use common::{Backend, Broker, Db};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const API_KEY: &str = "sk_test_idem";

#[derive(Default)]
struct Api {
    /// Customers created, per Idempotency-Key: the side effect that must happen once.
    created: HashMap<String, u32>,
    /// Calls that reached the API per key, side effect or not.
    calls: HashMap<String, u32>,
    next_id: u32,
}

/// `POST /v1/customers` of a payments API: authenticated, and a little unreliable for two keys.
async fn customers(State(api): State<Arc<Mutex<Api>>>, headers: HeaderMap, body: String) -> Response {
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(&format!("Bearer {API_KEY}")) {
        let error = json!({"error": {"type": "invalid_request_error", "message": "Invalid API Key provided"}});
        return (StatusCode::UNAUTHORIZED, axum::Json(error)).into_response();
    }
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let call = {
        let mut api = api.lock().unwrap();
        let call = api.calls.entry(key.clone()).or_default();
        *call += 1;
        *call
    };
    match (key.as_str(), call) {
        ("busy-1", 1) => return (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")], "busy").into_response(),
        ("lost-1", 1) => tokio::time::sleep(Duration::from_millis(1500)).await,
        ("dup-1", _) => tokio::time::sleep(Duration::from_millis(300)).await,
        _ => {}
    }
    let name = body
        .split('&')
        .find_map(|pair| pair.strip_prefix("name="))
        .map(|n| percent_encoding::percent_decode_str(&n.replace('+', " ")).decode_utf8_lossy().into_owned());
    let id = {
        let mut api = api.lock().unwrap();
        *api.created.entry(key).or_default() += 1;
        api.next_id += 1;
        format!("cus_{}", api.next_id)
    };
    axum::Json(json!({"id": id, "object": "customer", "name": name})).into_response()
}

/// The interpreter that has `stripe`, or `None` (skip) outside CI.
fn python() -> Option<String> {
    let python = std::env::var("IDEM_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdk =
        std::process::Command::new(&python).args(["-c", "import stripe"]).output().is_ok_and(|o| o.status.success());
    match has_sdk {
        true => Some(python),
        false if std::env::var_os("CI").is_some() => panic!("{python} cannot import stripe: .ci/run installs it"),
        false => {
            eprintln!("skipped the SDK test: {python} has no `stripe` (pip install stripe, or set IDEM_TEST_PYTHON)");
            None
        }
    }
}

async fn run(python: &str, base: &str, scenario: &str) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/stripe_scenarios.py");
    let run = tokio::process::Command::new(python).args([script, base, scenario]).output();
    let out = tokio::time::timeout(Duration::from_secs(90), run).await.expect("the SDK finished").unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{scenario}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{scenario}: not JSON: {stdout}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_python_gets_exactly_once_through_idem() {
    let Some(python) = python() else { return };
    let api = Arc::new(Mutex::new(Api::default()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/v1/customers", axum::routing::post(customers)).with_state(api.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let db = Db::new(Backend::Sqlite).await;
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[store]\nurl = \"{}\"\n\
         [[routes]]\nname = \"stripe\"\npath_prefix = \"/v1\"\nupstream = \"{upstream}\"\n\
         forward_authorization = true\n[routes.retry]\nbase = \"50ms\"\n",
        db.url
    );
    let broker = Broker::start_with(&db, config).await;
    let created = |key: &str| api.lock().unwrap().created.get(key).copied().unwrap_or(0);

    let lost = run(&python, &broker.url, "lost_response").await;
    assert!(lost["id"].as_str().is_some_and(|id| id.starts_with("cus_")), "{lost}");
    assert_eq!(created("lost-1"), 1, "{lost}");

    let busy = run(&python, &broker.url, "unavailable_then_ok").await;
    assert!(busy["id"].as_str().is_some_and(|id| id.starts_with("cus_")), "{busy}");
    assert_eq!(created("busy-1"), 1);
    assert_eq!(api.lock().unwrap().calls["busy-1"], 2, "Idem retried the 503 itself");

    let dups = run(&python, &broker.url, "concurrent_duplicates").await;
    let results = dups["results"].as_array().unwrap();
    assert_eq!(results.len(), 20);
    let ids: std::collections::HashSet<&str> = results.iter().map(|r| r["id"].as_str().unwrap_or("none")).collect();
    assert_eq!(ids.len(), 1, "every thread got the one customer: {dups}");
    assert_eq!(created("dup-1"), 1);

    let reused = run(&python, &broker.url, "key_reused").await;
    assert!(reused["first"]["id"].as_str().is_some(), "{reused}");
    // Read as an error of the API's, with its code and message, not "Invalid response object".
    // (stripe-python names it IdempotencyError only for a 400 or 404; SPEC's status is 422.)
    assert_eq!(reused["second"]["error"], "APIError", "{reused}");
    assert_eq!(reused["second"]["status"], 422, "{reused}");
    assert_eq!(reused["second"]["code"], "idempotency-key-reused", "{reused}");
    assert!(reused["second"]["message"].as_str().is_some_and(|m| m.contains("different request")), "{reused}");
    assert_eq!(created("reused-1"), 1);
    broker.stop().await;
}
