//! Reloading the configuration without a restart (docs/configuration.md), on both stores: a bad file is
//! refused and the running configuration kept; a good one adds, changes and removes routes, and
//! new attempts carry the new `policy_version`; records in flight finish under the policy they
//! started with; a restart-only key is refused whole; `SIGHUP` does it for a real `idem serve`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::process::{node_config, Node};
use crate::common::{both_stores, send, Answer, Backend, Broker, Db, JsonOf, Reply, TestConfig, Upstream};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

const BODY: &str = r#"{"amount":7}"#;

/// A config on ports 0 (which a reload keeps: it compares what is written) with `routes`.
fn config(db: &Db, worker: &str, routes: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nurl = \"{}\"\n[worker]\n{worker}\n{routes}",
        db.url
    )
}

/// A route table: `name` at `/name` in front of `upstream`, with `max_attempts` and fast
/// backoff, plus `extra` lines in its `[routes.retry]`.
fn route(name: &str, upstream: &str, max_attempts: u32) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}\"\nupstream = \"{upstream}\"\n\
         [routes.retry]\nmax_attempts = {max_attempts}\nbase = \"10ms\"\ncap = \"20ms\"\n"
    )
}

/// Each route's `policy_version`, as `GET /_idem/routes` shows it.
async fn versions(http: &reqwest::Client, base: &str) -> HashMap<String, String> {
    let routes = http.get(format!("{base}/_idem/routes")).json_of().await;
    routes["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_string(), r["policy_version"].as_str().unwrap().to_string()))
        .collect()
}

fn attempt_versions(record: &Value) -> Vec<&str> {
    record["attempts"].as_array().unwrap().iter().map(|a| a["policy_version"].as_str().unwrap()).collect()
}

/// The value of the series whose line starts with `series` (name and labels, as rendered).
fn sample(text: &str, series: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0.0)
}

fn refusal_names(answer: &Answer, key: &str) {
    answer.assert_problem(422, "config-refused");
    let problem = answer.json();
    assert_eq!(problem["key"], key, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains(&format!("`{key}`")), "{problem}");
}

async fn a_bad_file_is_refused_and_a_good_one_adds_changes_and_removes_routes(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let up = upstream.url();
    let broker =
        Broker::start_with(&db, config(&db, "", &(route("payments", &up, 3) + &route("ledger", &up, 3)))).await;
    let before = versions(&broker.http, &broker.url).await;
    let old = before["payments"].clone();
    assert_eq!(old.len(), 12);
    assert_eq!(send(broker.post("/payments", "k1", BODY)).await.status, 201);
    assert_eq!(attempt_versions(&broker.record_json("k1").await), [old.as_str()]);
    let refused_before = sample(&broker.metrics().await, "idem_config_reloads_total{result=\"refused\"}");

    // A file the loader refuses: the running configuration stays, and serves as before.
    let bad = route("payments", &up, 0) + &route("ledger", &up, 3);
    broker.write_config(&config(&db, "", &bad));
    refusal_names(&broker.reload(None).await, "routes[0].retry.max_attempts");
    assert_eq!(versions(&broker.http, &broker.url).await, before);
    assert_eq!(send(broker.post("/payments", "k2", BODY)).await.status, 201);
    assert_eq!(send(broker.post("/ledger", "k3", BODY)).await.status, 201);
    let text = broker.metrics().await;
    assert!(sample(&text, "idem_config_reloads_total{result=\"refused\"}") > refused_before, "{text}");

    // A key the loader does not know: refused in one line that names the file, the line and the
    // key, with the key in the problem's `key` member.
    broker.write_config(&config(&db, "", &(route("payments", &up, 3) + "retries = 3\n")));
    let refused = broker.reload(None).await;
    refused.assert_problem(422, "config-refused");
    let problem = refused.json();
    let detail = problem["detail"].as_str().unwrap();
    assert_eq!(problem["key"], "retries", "{problem}");
    assert!(!detail.contains('\n') && detail.contains(&broker.config_file.display().to_string()), "{detail}");
    assert!(detail.contains("(`retries = 3`): unknown field `retries`"), "{detail}");
    assert_eq!(detail.matches("unknown field").count(), 1, "{detail}");

    // A good one: payments changes its policy, ledger goes, tickets comes.
    let good = route("payments", &up, 2) + &route("tickets", &up, 3);
    broker.write_config(&config(&db, "", &good));
    let applied = broker.reload(None).await;
    assert_eq!(applied.status, 200, "{:?}", applied.body);
    let answer = applied.json();
    assert_eq!(answer["result"], "applied");
    let now = versions(&broker.http, &broker.url).await;
    let new = now["payments"].clone();
    assert_ne!(new, old);
    let changes = &answer["changes"];
    assert_eq!(changes["added"], serde_json::json!([{"name": "tickets", "policy_version": now["tickets"]}]));
    assert_eq!(changes["removed"], serde_json::json!([{"name": "ledger", "policy_version": before["ledger"]}]));
    assert_eq!(changes["changed"][0]["name"], "payments");
    assert_eq!(changes["changed"][0]["policy_version"], serde_json::json!({"old": old, "new": new}));
    assert_eq!(changes["changed"][0]["keys"], serde_json::json!(["retry"]));
    assert!(answer["loaded_at"].as_str().is_some_and(|t| t.ends_with('Z')), "{answer}");

    assert_eq!(send(broker.post("/tickets", "k4", BODY)).await.status, 201);
    send(broker.post("/ledger", "k5", BODY)).await.assert_problem(404, "no-route");
    upstream.script("k6", vec![Reply::status(503), Reply::status(201)]);
    assert_eq!(send(broker.post("/payments", "k6", BODY)).await.status, 201);
    assert_eq!(attempt_versions(&broker.record_json("k6").await), [new.as_str(), new.as_str()]);
    // Records of before the reload keep the version they were executed under.
    assert_eq!(attempt_versions(&broker.record_json("k1").await), [old.as_str()]);
    let text = broker.metrics().await;
    assert!(text.contains(&format!("policy_version=\"{new}\"")), "{text}");
    broker.stop().await;
}

/// An upstream that holds the first attempt of each key starting with `held` until the test
/// releases it, then answers 503; every later attempt is answered 201. Keys starting with `once`
/// get 503 on their first attempt at once. Each arrival is announced.
struct Holding {
    url: String,
    arrivals: mpsc::UnboundedReceiver<String>,
    release: Arc<Semaphore>,
    hits: Arc<Mutex<HashMap<String, u32>>>,
}

async fn holding_upstream() -> Holding {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, arrivals) = mpsc::unbounded_channel();
    let release = Arc::new(Semaphore::new(0));
    let hits = Arc::new(Mutex::new(HashMap::new()));
    let (gate, counts) = (release.clone(), hits.clone());
    let app = axum::Router::new().fallback(move |headers: HeaderMap| {
        let (tx, gate, counts) = (tx.clone(), gate.clone(), counts.clone());
        async move {
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            let n = {
                let mut counts = counts.lock().unwrap();
                let n = counts.entry(key.clone()).or_insert(0);
                *n += 1;
                *n
            };
            let _ = tx.send(key.clone());
            if n == 1 && key.starts_with("held") {
                gate.acquire().await.unwrap().forget();
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            if n == 1 && key.starts_with("once") {
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            (StatusCode::CREATED, "{\"ok\":true}").into_response()
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Holding { url, arrivals, release, hits }
}

async fn a_record_in_flight_during_a_reload_finishes_under_the_policy_it_started_with(b: Backend) {
    let mut upstream = holding_upstream().await;
    let db = Db::new(b).await;
    let up = upstream.url.clone();
    let broker =
        Broker::start_with(&db, config(&db, "", &(route("payments", &up, 3) + &route("ledger", &up, 3)))).await;
    let before = versions(&broker.http, &broker.url).await;
    let held: Vec<_> = [("/payments", "held-pay"), ("/ledger", "held-ledger")]
        .into_iter()
        .map(|(path, key)| {
            let request = broker.post(path, key, BODY);
            tokio::spawn(async move { send(request).await })
        })
        .collect();
    let mut arrived = Vec::new();
    while arrived.len() < 2 {
        arrived.push(upstream.arrivals.recv().await.unwrap());
    }

    // While both first attempts are held: payments drops to one attempt, ledger goes.
    broker.write_config(&config(&db, "", &route("payments", &up, 1)));
    assert_eq!(broker.reload(None).await.status, 200);
    let new = versions(&broker.http, &broker.url).await["payments"].clone();
    assert_ne!(new, before["payments"]);

    // Released, both first attempts answer 503: each retries under the policy it started with.
    upstream.release.add_permits(2);
    for answer in held {
        assert_eq!(answer.await.unwrap().status, 201);
    }
    for (key, route) in [("held-pay", "payments"), ("held-ledger", "ledger")] {
        let record = broker.record_json(key).await;
        assert_eq!(record["state"], "done");
        assert_eq!(attempt_versions(&record), [before[route].as_str(), before[route].as_str()], "{record}");
        assert_eq!(upstream.hits.lock().unwrap()[key], 2);
    }

    // A new request gets the new policy: one attempt, and its 503 is the answer.
    assert_eq!(send(broker.post("/payments", "once-after", BODY)).await.status, 503);
    let record = broker.record_json("once-after").await;
    assert_eq!(attempt_versions(&record), [new.as_str()]);
    assert_eq!(record["stop_reason"], "attempt_cap");
    send(broker.post("/ledger", "held-late", BODY)).await.assert_problem(404, "no-route");
    broker.stop().await;
}

async fn a_change_of_a_restart_only_key_is_refused_whole(b: Backend) {
    std::env::set_var("IDEM_TEST_RELOAD_TOKEN", "reload-secret");
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let up = upstream.url();
    let auth = "[auth]\nadmin_token_env = \"IDEM_TEST_RELOAD_TOKEN\"\n";
    let broker = Broker::start_with(&db, config(&db, "", &format!("{auth}{}", route("payments", &up, 3)))).await;
    let before = versions(&broker.http, &broker.url).await;

    // The endpoint takes the admin token like every operator call.
    broker.reload(None).await.assert_problem(401, "unauthorized");
    broker.reload(Some("wrong")).await.assert_problem(401, "unauthorized");

    // A new route and another worker pool: refused whole, the route is not half-applied.
    let routes = format!("{auth}{}{}", route("payments", &up, 3), route("tickets", &up, 3));
    broker.write_config(&config(&db, "concurrency = 7", &routes));
    refusal_names(&broker.reload(Some("reload-secret")).await, "worker.concurrency");
    assert_eq!(versions(&broker.http, &broker.url).await, before);
    send(broker.post("/tickets", "t1", BODY)).await.assert_problem(404, "no-route");

    // Without the restart-only change, the same file applies.
    broker.write_config(&config(&db, "", &routes));
    assert_eq!(broker.reload(Some("reload-secret")).await.status, 200);
    assert_eq!(send(broker.post("/tickets", "t2", BODY)).await.status, 201);
    broker.stop().await;
}

async fn a_broker_started_without_a_file_says_it_has_nothing_to_reload(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let text = config(&db, "", &route("payments", &upstream.url(), 3));
    let running = idem::server::start(idem::config::Config::parse(&text).unwrap()).await.unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let answer = send(http.post(format!("http://{}/admin/config/reload", running.admin_listen))).await;
    answer.assert_problem(409, "reload-unavailable");
    assert!(answer.json()["detail"].as_str().unwrap().contains("running configuration is kept"));
    let served =
        send(crate::common::keyed_post(&http, &format!("http://{}", running.listen), "/payments", "k", BODY)).await;
    assert_eq!(served.status, 201);
    running.shutdown().await;
}

/// Polls `what` until it holds, every 25 ms; fails after `within`.
async fn eventually<F, Fut>(what: &str, within: Duration, check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < until, "waited {within:?} in vain for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn sighup_makes_a_running_idem_serve_read_its_file_again(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let up = upstream.url();
    let node = Node::start("broker", &node_config(&db.url, TestConfig::new(&up)).body()).await;
    let before = versions(&node.http, &node.url).await;

    // A bad file: logged with its key, counted, and the process serves on as before.
    node.write_config(&node_config(&db.url, TestConfig::new(&up).route("max_body = \"none\"")).body());
    node.hangup();
    eventually("the refusal in the log", Duration::from_secs(10), || async {
        node.log_tail(20).contains("configuration reload refused")
    })
    .await;
    assert!(node.log_tail(20).contains("routes[0].max_body"), "{}", node.log_tail(20));
    assert!(node.is_running());
    assert_eq!(versions(&node.http, &node.url).await, before);

    // A good one: the new route is served, the change is logged with the versions.
    let tickets = format!("[[routes]]\nname = \"tickets\"\npath_prefix = \"/tickets\"\nupstream = \"{up}\"\n");
    node.write_config(&node_config(&db.url, TestConfig::new(&up).tables(&tickets)).body());
    node.hangup();
    eventually("the new route", Duration::from_secs(10), || async {
        versions(&node.http, &node.url).await.contains_key("tickets")
    })
    .await;
    let answer = send(node.post("/tickets", "t1", BODY)).await;
    assert_eq!(answer.status, 201);
    let after = versions(&node.http, &node.url).await;
    // Log lines reach the file within moments, not at once: the change is awaited in the log too.
    let added = format!("added tickets ({})", after["tickets"]);
    eventually("the change in the log", Duration::from_secs(10), || async { node.log_tail(20).contains(&added) }).await;
    let text = node.metrics().await;
    assert_eq!(sample(&text, "idem_config_reloads_total{result=\"refused\"}"), 1.0, "{text}");
    assert_eq!(sample(&text, "idem_config_reloads_total{result=\"applied\"}"), 1.0, "{text}");
}

both_stores!(
    a_bad_file_is_refused_and_a_good_one_adds_changes_and_removes_routes,
    a_record_in_flight_during_a_reload_finishes_under_the_policy_it_started_with,
    a_change_of_a_restart_only_key_is_refused_whole,
    sighup_makes_a_running_idem_serve_read_its_file_again,
    a_broker_started_without_a_file_says_it_has_nothing_to_reload,
);

/// `idem reload` asks a running node to read its file again and waits for the answer: it exits
/// 0 saying what changed when the file is applied, and non-zero with the key and reason when it
/// is refused, so that `systemctl reload` (its `ExecReload`) tells the truth.
#[tokio::test]
async fn idem_reload_exits_non_zero_with_the_reason_when_the_file_is_refused() {
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    let up = upstream.url();
    let broker = Broker::start_with(&db, config(&db, "", &route("payments", &up, 3))).await;
    // Run without blocking: the broker serves on this test's runtime.
    let reload = || {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        command.args(["reload", "--admin", &broker.admin]);
        async move {
            let out = command.output().await.unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };

    broker.write_config(&config(&db, "", &(route("payments", &up, 2) + &route("tickets", &up, 3))));
    let (ok, stdout, stderr) = reload().await;
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with("applied") && stdout.contains("1 route(s) added, 1 changed"), "{stdout}");

    broker.write_config(&config(&db, "", &route("payments", &up, 0)));
    let (ok, stdout, stderr) = reload().await;
    assert!(!ok && stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains("routes[0].retry.max_attempts") && stderr.contains("nothing of the file was applied"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
