//! Automatic reconciliation (docs/operations.md): an `unknown` record on a route with a `probe` is settled
//! by asking the upstream — 2xx → `done` with the probe's answer, 404 → the key is freed,
//! anything else → still `unknown`, asked again later with backoff — and never sent again.

use crate::common::JsonOf;

use crate::common::{both_stores, Backend, Broker, Db, Reply, TestConfig};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use idem::domain::clock::{Clock, ManualClock};
use serde_json::Value;
use tokio::net::TcpListener;

const BODY: &str = r#"{"amount":42}"#;
const SETTLE: Duration = Duration::from_millis(200);
/// How long after its mark an attempt may still reach the upstream: `send_window` +
/// `per_try_timeout` + `clock_margin`, as the routes here set them. Longer than `SETTLE`: the
/// first probe comes while the 504's attempt could still execute.
const SEND_WINDOW: Duration = Duration::from_millis(50);
const PER_TRY: Duration = Duration::from_millis(600);
const MARGIN: Duration = Duration::from_millis(50);

/// One request that reached the upstream.
#[derive(Clone, Debug)]
struct Seen {
    op: String,
    method: Method,
    path: String,
    at: Instant,
}

#[derive(Default)]
struct Log {
    seen: Vec<Seen>,
    /// Answers per operation (`POST <key>` or `GET <path>`): the n-th request gets the n-th
    /// answer, and the last one repeats.
    scripts: HashMap<String, Vec<Reply>>,
}

/// A fake upstream that tells the operation (a keyed POST) from the probes about it (GETs of
/// the probe path), since the broker sends the Idempotency-Key with both.
#[derive(Clone)]
struct Payments {
    addr: SocketAddr,
    log: Arc<Mutex<Log>>,
}

fn operation(method: &Method, path: &str, headers: &HeaderMap) -> String {
    if method == Method::POST {
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("");
        format!("POST {key}")
    } else {
        format!("{method} {path}")
    }
}

async fn answer(State(log): State<Arc<Mutex<Log>>>, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    let op = operation(&method, uri.path(), &headers);
    let scripted = {
        let mut log = log.lock().unwrap();
        log.seen.push(Seen {
            op: op.clone(),
            method: method.clone(),
            path: uri.path().to_string(),
            at: Instant::now(),
        });
        let n = log.seen.iter().filter(|s| s.op == op).count();
        log.scripts.get(&op).and_then(|replies| replies.get(n - 1).or(replies.last()).cloned())
    };
    let reply =
        scripted.unwrap_or_else(|| if method == Method::POST { Reply::status(201) } else { Reply::status(404) });
    tokio::time::sleep(reply.delay).await;
    let mut response = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    for (name, value) in reply.headers {
        response
            .headers_mut()
            .insert(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
    }
    response
}

impl Payments {
    async fn start() -> Payments {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Log::default()));
        let app = axum::Router::new().fallback(answer).with_state(log.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Payments { addr, log }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn script(&self, op: &str, replies: Vec<Reply>) {
        self.log.lock().unwrap().scripts.insert(op.to_string(), replies);
    }

    /// When each request of `method` to `path` arrived.
    fn arrivals(&self, method: Method, path: &str) -> Vec<Instant> {
        self.log.lock().unwrap().seen.iter().filter(|s| s.method == method && s.path == path).map(|s| s.at).collect()
    }

    fn posts(&self) -> Vec<Instant> {
        self.arrivals(Method::POST, "/payments")
    }

    fn probes(&self, key: &str) -> Vec<Instant> {
        self.arrivals(Method::GET, &format!("/payments/by-key/{key}"))
    }
}

/// A broker whose non-replay-safe `payments` route probes `GET /payments/by-key/{key}`.
async fn setup(b: Backend) -> (Payments, Broker) {
    setup_with(b, SETTLE, None).await
}

/// The same with another `settle`, and on `clock` when one is given.
async fn setup_with(b: Backend, settle: Duration, clock: Option<Arc<ManualClock>>) -> (Payments, Broker) {
    let upstream = Payments::start().await;
    let extra = format!(
        "[routes.retry]\nbase = \"10ms\"\nper_try_timeout = \"{}ms\"\nmin_try = \"10ms\"\n\n[routes.probe]\nmethod = \"GET\"\n\
         path = \"/payments/by-key/{{idempotency_key}}\"\nsettle = \"{}ms\"\n",
        PER_TRY.as_millis(),
        settle.as_millis()
    );
    let worker =
        format!("send_window = \"{}ms\"\nclock_margin = \"{}ms\"", SEND_WINDOW.as_millis(), MARGIN.as_millis());
    let db = Db::new(b).await;
    let broker = match clock {
        Some(clock) => {
            Broker::start_with_clock(
                &db,
                TestConfig::new(&upstream.url()).route("replay_safe = false").worker(&worker).tables(&extra),
                clock,
            )
            .await
        }
        None => {
            let config = TestConfig::new(&upstream.url()).route("replay_safe = false").worker(&worker).tables(&extra);
            Broker::start(&db, config).await
        }
    };
    (upstream, broker)
}

/// Sends `key` once; the upstream's 504 leaves it `unknown`.
async fn make_unknown(upstream: &Payments, broker: &Broker, key: &str, then: Vec<Reply>) {
    upstream.script(&format!("POST {key}"), [vec![Reply::status(504)], then].concat());
    crate::common::send(broker.post("/payments", key, BODY)).await.assert_problem(502, "outcome-unknown");
}

fn probe_entries(record: &Value) -> Vec<&Value> {
    record["history"].as_array().unwrap().iter().filter(|e| e["actor"] == "probe").collect()
}

fn at(entry: &Value) -> SystemTime {
    humantime::parse_rfc3339(entry["at"].as_str().unwrap()).unwrap()
}

async fn a_probe_answering_2xx_settles_the_record_done_with_the_probes_answer(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let found = Reply {
        body: r#"{"id":"pay_7","state":"captured"}"#.into(),
        ..Reply::status(200).header("content-type", "application/json")
    };
    upstream.script("GET /payments/by-key/found", vec![found]);
    make_unknown(&upstream, &broker, "found", vec![]).await;
    let unknown_since = Instant::now();

    let record = broker.await_record("found", Duration::from_secs(5), |r| r["state"] != "unknown").await;
    assert_eq!(record["state"], "done", "{record:#}");
    assert_eq!(record["response"]["status"], 200, "{record:#}");
    assert_eq!(record["response"]["body"], r#"{"id":"pay_7","state":"captured"}"#);
    assert_eq!(record["response"]["headers"]["content-type"], "application/json");
    let probes = probe_entries(&record);
    assert_eq!(probes.len(), 1, "{record:#}");
    assert!(probes[0]["note"].as_str().unwrap().contains("GET /payments/by-key/found → 200"), "{record:#}");
    let asked = upstream.probes("found");
    assert_eq!(asked.len(), 1);
    assert!(asked[0] >= unknown_since + SETTLE, "probed before the outcome had settled");

    let replay = crate::common::send(broker.post("/payments", "found", BODY)).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotency-status"), Some("done"));
    assert_eq!(&replay.body[..], br#"{"id":"pay_7","state":"captured"}"#);

    // A settled record is neither probed again nor sent.
    tokio::time::sleep(4 * SETTLE + Duration::from_millis(600)).await;
    assert_eq!(upstream.probes("found").len(), 1);
    assert_eq!(upstream.posts().len(), 1);
}

/// A 504 is a gateway's answer: the service behind it may still execute the request within the
/// attempt's limit. The record keeps its attempt's whole bound, so the probe's first 404, asked
/// within it, frees nothing; asked again once the bound has passed, a 404 frees the key, and
/// the client's next request executes.
async fn a_probe_answering_404_frees_the_key_only_past_the_attempts_bound(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let sent = Instant::now();
    make_unknown(&upstream, &broker, "absent", vec![Reply::status(201)]).await;

    let record = broker.await_record("absent", Duration::from_secs(5), |r| r["state"] != "unknown").await;
    assert_eq!(record["state"], "not_started", "{record:#}");
    assert_eq!(record["queued"], false, "freed, not queued: nothing is sent until the client asks");
    let probes = probe_entries(&record);
    assert_eq!(probes.len(), 2, "{record:#}");
    let within = probes[0]["note"].as_str().unwrap();
    assert!(within.contains("→ 404") && within.contains("may still reach the upstream"), "{record:#}");
    assert!(probes[1]["note"].as_str().unwrap().contains("→ 404"), "{record:#}");
    let asked = upstream.probes("absent");
    assert!(asked[0] < sent + SEND_WINDOW + PER_TRY + MARGIN, "the first was asked within the bound");
    assert!(asked[1] >= sent + SEND_WINDOW + PER_TRY, "the one believed was asked past it: {:?}", asked[1] - sent);
    assert_eq!(upstream.posts().len(), 1, "a freed key is not sent before the client asks again");

    let again = crate::common::send(broker.post("/payments", "absent", BODY)).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), None, "executed afresh, not a replay");
    assert_eq!(upstream.posts().len(), 2);
    assert_eq!(broker.record_json("absent").await["state"], "done");
}

/// Waits until `key`'s record shows `n` probes, still `unknown`. The record, not the upstream,
/// is watched: the time of the next probe is stored with the probe's entry, after it was sent.
async fn await_probes(broker: &Broker, key: &str, n: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let record = broker.record_json(key).await;
        assert_eq!(record["state"], "unknown", "{record:#}");
        let probed = probe_entries(&record).len();
        if probed >= n {
            return;
        }
        assert!(Instant::now() < until, "probed {probed} times, not {n}: {record:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn a_probe_answering_500_leaves_the_record_unknown_and_asks_again_with_backoff(b: Backend) {
    // A settle of a minute, on a clock the test moves: the backoff is seen in the broker's time,
    // without waiting minutes for it.
    let settle = Duration::from_secs(60);
    let clock = Arc::new(ManualClock::starting_now());
    let (upstream, broker) = setup_with(b, settle, Some(clock.clone())).await;
    upstream.script("GET /payments/by-key/unsure", vec![Reply::status(500)]);
    make_unknown(&upstream, &broker, "unsure", vec![]).await;
    let unknown_at = clock.now();

    // First once the outcome has settled, then after twice the settle, then four times.
    for (n, wait) in [(1, settle), (2, 2 * settle), (3, 4 * settle)] {
        clock.advance(wait);
        await_probes(&broker, "unsure", n).await;
    }
    let record = broker.record_json("unsure").await;
    assert_eq!(record["state"], "unknown", "{record:#}");
    let probes = probe_entries(&record);
    assert_eq!(probes.len(), 3, "each probe waited for its backoff to pass: {record:#}");
    assert_eq!(upstream.probes("unsure").len(), 3);
    for entry in &probes {
        assert!(entry["note"].as_str().unwrap().contains("→ 500"), "{record:#}");
    }
    let since = |entry: &Value| idem::domain::Timestamp::from(at(entry)) - unknown_at;
    let offsets: Vec<Duration> = probes.iter().map(|e| since(e)).collect();
    assert_eq!(offsets, [60, 180, 420].map(Duration::from_secs), "probes at the settle, then backing off: {record:#}");

    crate::common::send(broker.post("/payments", "unsure", BODY)).await.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.posts().len(), 1, "an unknown record was sent upstream again");
    assert!(upstream.log.lock().unwrap().seen.iter().all(|s| s.method == Method::POST || s.path.contains("by-key")));
}

async fn a_key_that_would_climb_out_of_the_probe_path_is_never_probed(b: Backend) {
    let (upstream, broker) = setup(b).await;
    // `/payments/by-key/..` is `/payments/` to a URL parser: its 404 would free a key whose
    // operation may have executed, and the client's next retry would execute it again.
    make_unknown(&upstream, &broker, "..", vec![]).await;

    let until = Instant::now() + Duration::from_secs(5);
    let record = loop {
        // A URL client resolves `..` in `/_idem/requests/..` too: find the record as an operator.
        let listed: Value = broker.http.get(format!("{}/admin/requests?state=unknown", broker.admin)).json_of().await;
        let items = listed["items"].as_array().unwrap();
        assert_eq!(items.len(), 1, "{listed:#}");
        let id = items[0]["id"].as_str().unwrap();
        let record: Value = broker.http.get(format!("{}/admin/requests/{id}", broker.admin)).json_of().await;
        if !probe_entries(&record).is_empty() {
            break record;
        }
        assert!(Instant::now() < until, "no probe was tried: {record:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(record["state"], "unknown", "{record:#}");
    let note = probe_entries(&record)[0]["note"].as_str().unwrap().to_string();
    assert!(note.contains("not sent") && note.contains(".."), "{note}");
    let seen = upstream.log.lock().unwrap().seen.clone();
    assert!(seen.iter().all(|s| s.method == Method::POST), "a probe was sent: {seen:?}");
}

both_stores!(
    a_key_that_would_climb_out_of_the_probe_path_is_never_probed,
    a_probe_answering_2xx_settles_the_record_done_with_the_probes_answer,
    a_probe_answering_404_frees_the_key_only_past_the_attempts_bound,
    a_probe_answering_500_leaves_the_record_unknown_and_asks_again_with_backoff,
);
