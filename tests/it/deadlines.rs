//! Deadlines passed down (docs/concepts.md): each attempt tells the upstream its milliseconds in the
//! route's `deadline_header`; a client sending that header may shorten its deadline, never
//! lengthen it.

use std::time::{Duration, Instant, SystemTime};

use crate::common::{both_stores, send, Backend, Broker, Db, Reply, TestConfig, Upstream};
use serde_json::Value;

const BODY: &str = r#"{"amount":42}"#;
const HEADER: &str = "request-timeout-ms";

/// A replay-safe route with a 2 s deadline and 1 s per attempt, whose attempts carry the header.
async fn setup(b: Backend) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let route = "deadline_header = \"Request-Timeout-Ms\"\nreplay_safe = true\n\
                 [routes.retry]\ndeadline = \"2s\"\nper_try_timeout = \"1s\"\nbase = \"50ms\"\ncap = \"100ms\"\n\
                 [routes.circuit]\nfailures = 100\n";
    let broker = Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).route(route)).await;
    (upstream, broker)
}

fn told(upstream: &Upstream, key: &str) -> u64 {
    let headers = upstream.headers(key).expect("the upstream saw the request");
    let value = headers.get(HEADER).expect("the attempt carried the deadline header");
    value.to_str().unwrap().parse().unwrap()
}

/// The record's deadline, counted from its creation.
fn deadline_of(record: &Value) -> Duration {
    let at = |field: &str| -> SystemTime { humantime::parse_rfc3339(record[field].as_str().unwrap()).unwrap() };
    at("deadline_at").duration_since(at("created_at")).unwrap_or_default()
}

async fn every_attempt_tells_the_upstream_its_own_limit(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let r = send(broker.post("/payments", "told", BODY)).await;
    assert_eq!(r.status, 201);
    let ms = told(&upstream, "told");
    assert!(ms > 0 && ms <= 1000, "an attempt has at most per_try_timeout, told {ms}");
    // The header is the broker's, added at the send: the record does not keep it.
    let record = broker.record_json("told").await;
    assert!(!record.to_string().to_ascii_lowercase().contains(HEADER), "{record:#}");
}

async fn a_client_can_shorten_its_deadline(b: Backend) {
    let (upstream, broker) = setup(b).await;
    upstream.script("short", vec![Reply::hang(); 10]);
    let clock = Instant::now();
    let r = send(broker.post("/payments", "short", BODY).header("Request-Timeout-Ms", "300")).await;
    let took = clock.elapsed();
    r.assert_problem(504, "deadline-exceeded");
    assert!(took < Duration::from_millis(1500), "ended after {took:?}, not near 300 ms");
    assert!(told(&upstream, "short") <= 300);
    let record = broker.record_json("short").await;
    assert!(deadline_of(&record) <= Duration::from_millis(300), "{record:#}");
}

async fn a_client_cannot_lengthen_its_deadline(b: Backend) {
    let (upstream, broker) = setup(b).await;
    upstream.script("long", vec![Reply::hang(); 10]);
    let clock = Instant::now();
    let r = send(broker.post("/payments", "long", BODY).header("Request-Timeout-Ms", "60000")).await;
    let took = clock.elapsed();
    r.assert_problem(504, "deadline-exceeded");
    assert!(took < Duration::from_secs(5), "ended after {took:?}: the route's 2 s deadline holds");
    assert!(told(&upstream, "long") <= 1000);
    let record = broker.record_json("long").await;
    assert!(deadline_of(&record) <= Duration::from_secs(2), "{record:#}");
}

async fn a_malformed_client_deadline_is_ignored(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let r = send(broker.post("/payments", "typo", BODY).header("Request-Timeout-Ms", "soon")).await;
    assert_eq!(r.status, 201);
    let ms = told(&upstream, "typo");
    assert!(ms > 0 && ms <= 1000, "told {ms}");
    assert_eq!(deadline_of(&broker.record_json("typo").await), Duration::from_secs(2));
}

both_stores!(
    every_attempt_tells_the_upstream_its_own_limit,
    a_client_can_shorten_its_deadline,
    a_client_cannot_lengthen_its_deadline,
    a_malformed_client_deadline_is_ignored,
);
