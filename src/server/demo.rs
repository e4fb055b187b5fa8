//! `idem demo`: the broker on a fresh SQLite file in front of a built-in flaky "payments"
//! upstream that counts executions per key, so the behaviour can be seen with curl alone.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::server::{self, StartError};

/// The demo upstream's memory: executions per idempotency key, and keys that already failed once.
#[derive(Default)]
pub struct Payments {
    executions: Mutex<HashMap<String, u32>>,
    flaked: Mutex<HashMap<String, u32>>,
}

#[derive(Deserialize, Default)]
pub struct Behaviour {
    /// Answer 503 with `Retry-After: 1` this many times per key before executing.
    flaky: Option<u32>,
    /// Hang this many seconds before answering (longer than the per-try timeout: `unknown`).
    hang: Option<u64>,
    /// Execute, then answer with this status instead of 201.
    status: Option<u16>,
}

pub fn payments_router(state: Arc<Payments>) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/by-key/{key}", get(payment_by_key))
        .with_state(state)
}

async fn create_payment(
    State(payments): State<Arc<Payments>>,
    Query(behaviour): Query<Behaviour>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key =
        headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("(none)").trim_matches('"').to_string();
    if let Some(times) = behaviour.flaky {
        let mut flaked = payments.flaked.lock().unwrap_or_else(|p| p.into_inner());
        let count = flaked.entry(key.clone()).or_default();
        if *count < times {
            *count += 1;
            return (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")], "busy, try again\n").into_response();
        }
    }
    if let Some(secs) = behaviour.hang {
        // The payment executes, but the answer comes too late: the broker cannot know.
        payments.count(&key);
        tokio::time::sleep(Duration::from_secs(secs)).await;
    }
    let executions = if behaviour.hang.is_some() { payments.executions(&key) } else { payments.count(&key) };
    let amount = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("amount").cloned())
        .unwrap_or(json!(null));
    let status = behaviour.status.and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::CREATED);
    let reply = json!({
        "id": format!("pay_{}", uuid::Uuid::new_v4().simple()),
        "amount": amount,
        "idempotency_key": key,
        "executions": executions,
    });
    (status, [("content-type", "application/json")], reply.to_string()).into_response()
}

async fn payment_by_key(State(payments): State<Arc<Payments>>, Path(key): Path<String>) -> Response {
    match payments.executions(&key) {
        0 => (StatusCode::NOT_FOUND, "no such payment\n").into_response(),
        n => axum::Json(json!({"idempotency_key": key, "executions": n})).into_response(),
    }
}

impl Payments {
    fn count(&self, key: &str) -> u32 {
        let mut map = self.executions.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(key.to_string()).or_default();
        *n += 1;
        *n
    }

    pub fn executions(&self, key: &str) -> u32 {
        self.executions.lock().unwrap_or_else(|p| p.into_inner()).get(key).copied().unwrap_or(0)
    }
}

/// The demo's config: one `payments` route in front of the demo upstream.
pub fn demo_config(listen: SocketAddr, admin_listen: SocketAddr, upstream: SocketAddr, db: &std::path::Path) -> String {
    format!(
        r#"
[server]
listen = "{listen}"
admin_listen = "{admin_listen}"

[store]
url = "sqlite://{db}"
retention = "24h"

[[routes]]
name = "payments"
path_prefix = "/payments"
upstream = "http://{upstream}"
methods = ["POST"]
replay_safe = false

[routes.retry]
max_attempts = 3
deadline = "10s"
per_try_timeout = "2s"
base = "200ms"
cap = "2s"

[routes.probe]
method = "GET"
path = "/payments/by-key/{{idempotency_key}}"
settle = "1s"
"#,
        db = db.display()
    )
}

/// One line of the scenario's table.
struct Step {
    request: &'static str,
    got: String,
    attempts: usize,
    took: Duration,
    state: String,
}

/// Runs the scenario the demo opens with and renders its table: a new key, a replay, a key
/// reused with another body, a 503 + Retry-After recovered by a retry, and a hang that ends
/// `unknown` and is then settled by the route's probe.
pub async fn scenario(base: &str) -> String {
    let http = reqwest::Client::builder().no_proxy().build().expect("a static client configuration");
    let mut steps = Vec::new();
    let plan: [(&'static str, &str, &str, &str); 5] = [
        ("POST /payments, new key", "/payments", "scenario-1", r#"{"amount": 42}"#),
        ("the same again (re-serialised)", "/payments", "scenario-1", r#"{ "amount" : 42 }"#),
        ("same key, another body", "/payments", "scenario-1", r#"{"amount": 99}"#),
        ("503 + Retry-After: 1, then ok", "/payments?flaky=1", "scenario-2", r#"{"amount": 7}"#),
        ("hangs past the per-try timeout", "/payments?hang=30", "scenario-3", r#"{"amount": 5}"#),
    ];
    for (request, path, key, body) in plan {
        let started = std::time::Instant::now();
        let answer = http
            .post(format!("{base}{path}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        let took = started.elapsed();
        let got = match answer {
            Ok(r) => {
                let replayed = r.headers().contains_key("idempotent-replayed");
                let status = r.status().as_u16();
                let text = r.text().await.unwrap_or_default();
                let problem = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v["type"].as_str().map(|t| t.trim_start_matches("urn:idem:problem:").to_string()));
                match (replayed, problem) {
                    (true, _) => format!("{status} replayed"),
                    (false, Some(name)) => format!("{status} {name}"),
                    (false, None) => format!("{status}"),
                }
            }
            Err(e) => format!("error: {e}"),
        };
        let record = record(&http, base, key).await;
        steps.push(Step {
            request,
            got,
            attempts: record["attempts"].as_array().map_or(0, Vec::len),
            took,
            state: record["state"].as_str().unwrap_or("-").to_string(),
        });
    }
    // The unknown one waits for the probe: the upstream did execute it, so it becomes done.
    let started = std::time::Instant::now();
    let mut settled = record(&http, base, "scenario-3").await;
    while settled["state"] == "unknown" && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        settled = record(&http, base, "scenario-3").await;
    }
    let probe = settled["history"].as_array().and_then(|h| h.last()).and_then(|h| h["note"].as_str()).unwrap_or("-");
    steps.push(Step {
        request: "…then the probe asks the upstream",
        got: probe.to_string(),
        attempts: settled["attempts"].as_array().map_or(0, Vec::len),
        took: started.elapsed(),
        state: settled["state"].as_str().unwrap_or("-").to_string(),
    });

    let mut out = format!("  {:<36} {:<44} {:>8} {:>9}  {}\n", "request", "client got", "attempts", "time", "state");
    for s in steps {
        out.push_str(&format!(
            "  {:<36} {:<44} {:>8} {:>7}ms  {}\n",
            s.request,
            s.got,
            s.attempts,
            s.took.as_millis(),
            s.state
        ));
    }
    out.push('\n');
    out
}

async fn record(http: &reqwest::Client, base: &str, key: &str) -> serde_json::Value {
    match http.get(format!("{base}/_idem/requests/{key}")).send().await {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    }
}

pub async fn run(listen: SocketAddr, admin_listen: SocketAddr) -> Result<(), StartError> {
    let upstream_listener = TcpListener::bind("127.0.0.1:0").await.map_err(|cause| StartError::Bind {
        addr: "127.0.0.1:0".parse().expect("a literal address"),
        setting: "the demo's own upstream",
        cause,
    })?;
    let upstream = upstream_listener.local_addr().map_err(|cause| StartError::Bind {
        addr: "127.0.0.1:0".parse().expect("a literal address"),
        setting: "the demo's own upstream",
        cause,
    })?;
    tokio::spawn(async move {
        let _ = axum::serve(upstream_listener, payments_router(Arc::new(Payments::default()))).await;
    });

    let db = std::env::temp_dir().join(format!("idem-demo-{}.db", std::process::id()));
    let config = Config::parse(&demo_config(listen, admin_listen, upstream, &db))
        .map_err(|e| StartError::Store(crate::store::StoreError::Unavailable(e.to_string())))?;
    let running = server::start(config).await?;
    let base = format!("http://{}", running.listen);
    println!("Idem demo: a short scripted scenario first, against the flaky demo upstream…\n");
    print!("{}", scenario(&base).await);
    println!(
        r#"Idem demo
  broker      {base}          (routes /payments/* to the demo upstream)
  console     http://{admin}/   (open Health: attempts beside requests, amplification, success, the unknown queue)
  admin API   http://{admin}/admin/stats, /admin/requests, /metrics
  upstream    http://{upstream}   (a flaky payments service; counts executions per key)
  store       {db}
  logs        warnings only (`idem demo --verbose`, or RUST_LOG, for every request)

Try it:
  # a new key executes once; the same call again is replayed (Idempotent-Replayed: true)
  curl -i -X POST {base}/payments -H 'Idempotency-Key: order-1' -H 'content-type: application/json' -d '{{"amount": 42}}'
  curl -i -X POST {base}/payments -H 'Idempotency-Key: order-1' -H 'content-type: application/json' -d '{{ "amount" : 42 }}'
  # the same key with another body is refused (422)
  curl -i -X POST {base}/payments -H 'Idempotency-Key: order-1' -H 'content-type: application/json' -d '{{"amount": 99}}'
  # the upstream answers 503 + Retry-After once; the broker waits and retries
  curl -i -X POST '{base}/payments?flaky=1' -H 'Idempotency-Key: order-2' -d '{{"amount": 7}}'
  # the upstream hangs past the per-try timeout: the outcome is unknown (502), never re-sent…
  curl -i -X POST '{base}/payments?hang=30' -H 'Idempotency-Key: order-3' -d '{{"amount": 5}}'
  # …until the route's probe asks the upstream (GET /payments/by-key/order-3) and settles it
  curl -s {base}/_idem/requests/order-3

Serving until Ctrl-C."#,
        admin = running.admin_listen,
        db = db.display(),
    );
    server::termination().await;
    running.shutdown().await;
    // The database and the write-ahead log and index WAL mode keeps beside it.
    for suffix in ["", "-wal", "-shm"] {
        let mut file = db.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
    Ok(())
}
