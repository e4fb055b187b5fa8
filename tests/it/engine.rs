//! The execution engine through real HTTP: retries, waits, Retry-After, deadlines, budgets,
//! the circuit breaker and load shedding.

use crate::common::{both_stores, Backend, Db, TestConfig};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{send, Broker, Reply, Upstream};

const BODY: &str = r#"{"amount":42}"#;

async fn setup(b: Backend, route_extra: &str, extra: &str) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let broker =
        Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).route(route_extra).tables(extra)).await;
    (upstream, broker)
}

async fn retry_after_is_honoured_between_real_attempts(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nbase = \"10ms\"\ncap = \"50ms\"\n").await;
    let busy = || Reply::status(503).header("retry-after", "1");
    upstream.script("ra", vec![busy(), busy(), Reply::status(201)]);
    let r = send(broker.post("/payments", "ra", BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotency-status"), Some("done"));
    let arrivals = upstream.arrivals("ra");
    assert_eq!(arrivals.len(), 3);
    for pair in arrivals.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= Duration::from_millis(1000), "attempts only {gap:?} apart");
    }
    let record = broker.record_json("ra").await;
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3);
    assert_eq!(attempts[0]["outcome"], "not_executed");
    assert_eq!(attempts[0]["wait_ms"], 0);
    assert!(attempts[1]["wait_ms"].as_u64().unwrap() >= 1000);
    assert_eq!(attempts[2]["status"], 201);
    assert_eq!(record["stop_reason"], "success");
}

async fn an_ambiguous_answer_is_retried_only_on_a_replay_safe_route(b: Backend) {
    let (upstream, broker) = setup(b, "replay_safe = true", "[routes.retry]\nbase = \"10ms\"\n").await;
    upstream.script("safe", vec![Reply::status(502), Reply::status(201)]);
    let r = send(broker.post("/payments", "safe", BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(upstream.hits("safe"), 2);

    let (upstream, broker) = setup(b, "replay_safe = false", "[routes.retry]\nbase = \"10ms\"\n").await;
    upstream.script("unsafe", vec![Reply::status(502), Reply::status(201)]);
    send(broker.post("/payments", "unsafe", BODY)).await.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.hits("unsafe"), 1);
}

async fn a_timeout_is_retried_on_a_replay_safe_route_and_the_late_answer_is_never_used(b: Backend) {
    let extra = "[routes.retry]\nper_try_timeout = \"300ms\"\nmin_try = \"50ms\"\nbase = \"10ms\"\n";
    let (upstream, broker) = setup(b, "replay_safe = true", extra).await;
    // The first answer comes after the per-try timeout, with a body that must never be seen.
    let late = Reply { body: "LATE".into(), ..Reply::status(201).delay(Duration::from_millis(800)) };
    upstream.script("slow", vec![late, Reply::status(201)]);
    let r = send(broker.post("/payments", "slow", BODY)).await;
    assert_eq!(r.status, 201);
    assert_ne!(&r.body[..], b"LATE");
    let record = broker.record_json("slow").await;
    assert_eq!(record["attempts"][0]["error"], "timed_out");
    assert_eq!(record["attempts"][1]["status"], 201);
}

async fn a_spent_retry_budget_stops_retries(b: Backend) {
    let extra = "[routes.retry]\nbudget_ratio = 0.0\nbudget_min_per_sec = 0\nbase = \"10ms\"\n";
    let (upstream, broker) = setup(b, "", extra).await;
    upstream.script("nobudget", vec![Reply::status(503), Reply::status(201)]);
    let r = send(broker.post("/payments", "nobudget", BODY)).await;
    assert_eq!(r.status, 503, "the upstream's own answer is returned");
    assert_eq!(r.header("idempotency-status"), Some("not_started"));
    assert_eq!(upstream.hits("nobudget"), 1);
    assert_eq!(broker.record_json("nobudget").await["stop_reason"], "retry_budget");
}

async fn a_retry_after_beyond_the_deadline_stops_at_once_without_sending(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\ndeadline = \"2s\"\nper_try_timeout = \"1s\"\n").await;
    upstream.script("later", vec![Reply::status(503).header("retry-after", "10"), Reply::status(201)]);
    let started = Instant::now();
    let r = send(broker.post("/payments", "later", BODY)).await;
    assert!(started.elapsed() < Duration::from_millis(900), "it slept: {:?}", started.elapsed());
    assert_eq!(r.status, 503);
    assert_eq!(r.header("retry-after"), Some("10"), "the client sees the upstream's wish");
    assert_eq!(upstream.hits("later"), 1);
    assert_eq!(broker.record_json("later").await["stop_reason"], "retry_after_beyond_deadline");
}

async fn retries_stop_at_the_end_to_end_deadline(b: Backend) {
    let extra = "[routes.retry]\nmax_attempts = 50\ndeadline = \"1s\"\nper_try_timeout = \"500ms\"\nmin_try = \"100ms\"\nbase = \"50ms\"\ncap = \"100ms\"\njitter = \"none\"\n";
    let (upstream, broker) = setup(b, "", extra).await;
    upstream.script("dl", (0..50).map(|_| Reply::status(503)).collect());
    let started = Instant::now();
    let r = send(broker.post("/payments", "dl", BODY)).await;
    let took = started.elapsed();
    assert_eq!(r.status, 503);
    assert!(took < Duration::from_millis(1300), "took {took:?}");
    let record = broker.record_json("dl").await;
    assert_eq!(record["stop_reason"], "deadline");
    let attempts = record["attempts"].as_array().unwrap().len();
    assert!((5..50).contains(&attempts), "{attempts} attempts in 1 s with 50-100 ms waits");
}

async fn garbage_retry_after_is_ignored_not_obeyed(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n").await;
    upstream.script("garbage", vec![Reply::status(503).header("retry-after", "soon-ish"), Reply::status(201)]);
    let started = Instant::now();
    let r = send(broker.post("/payments", "garbage", BODY)).await;
    assert_eq!(r.status, 201);
    assert!(started.elapsed() < Duration::from_millis(800));
}

async fn an_open_circuit_fails_fast_and_records_nothing(b: Backend) {
    let extra = "[routes.retry]\nmax_attempts = 1\n[routes.circuit]\nfailures = 2\nopen_for = \"30s\"\n";
    let (upstream, broker) = setup(b, "", extra).await;
    for key in ["c1", "c2"] {
        upstream.script(key, vec![Reply::status(503)]);
        assert_eq!(send(broker.post("/payments", key, BODY)).await.status, 503);
    }
    let r = send(broker.post("/payments", "c3", BODY)).await;
    r.assert_problem(503, "circuit-open");
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&wait));
    assert_eq!(upstream.hits("c3"), 0);
    assert_eq!(broker.record("c3").await.status(), 404, "nothing recorded");
}

async fn a_replay_is_served_even_while_the_circuit_is_open(b: Backend) {
    let extra = "[routes.retry]\nmax_attempts = 1\n[routes.circuit]\nfailures = 1\nopen_for = \"30s\"\n";
    let (upstream, broker) = setup(b, "", extra).await;
    let first = send(broker.post("/payments", "kept", BODY)).await;
    assert_eq!(first.status, 201);
    upstream.script("trip", vec![Reply::status(503)]);
    send(broker.post("/payments", "trip", BODY)).await;
    send(broker.post("/payments", "new", BODY)).await.assert_problem(503, "circuit-open");
    let replay = send(broker.post("/payments", "kept", BODY)).await;
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
}

async fn a_saturated_route_sheds_new_work_without_recording_it(b: Backend) {
    let (upstream, broker) = setup(b, "max_concurrency = 1", "").await;
    let broker = Arc::new(broker);
    let mut tasks = Vec::new();
    for i in 0..12 {
        let b = broker.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("load-{i}");
            (key.clone(), send(b.post("/payments?delay_ms=300", &key, BODY)).await)
        }));
    }
    let mut shed = Vec::new();
    let mut served = 0;
    for t in tasks {
        let (key, r) = t.await.unwrap();
        match r.status {
            201 => served += 1,
            503 => {
                r.assert_problem(503, "overloaded");
                assert!(r.header("retry-after").is_some());
                shed.push(key);
            }
            other => panic!("unexpected {other}"),
        }
    }
    // One in flight and four queued behind it are accepted; the rest is shed.
    assert_eq!(served, 5);
    assert_eq!(shed.len(), 7);
    for key in shed {
        assert_eq!(upstream.hits(&key), 0);
        assert_eq!(broker.record(&key).await.status(), 404);
    }
}

both_stores!(
    retry_after_is_honoured_between_real_attempts,
    an_ambiguous_answer_is_retried_only_on_a_replay_safe_route,
    a_timeout_is_retried_on_a_replay_safe_route_and_the_late_answer_is_never_used,
    a_spent_retry_budget_stops_retries,
    a_retry_after_beyond_the_deadline_stops_at_once_without_sending,
    retries_stop_at_the_end_to_end_deadline,
    garbage_retry_after_is_ignored_not_obeyed,
    an_open_circuit_fails_fast_and_records_nothing,
    a_replay_is_served_even_while_the_circuit_is_open,
    a_saturated_route_sheds_new_work_without_recording_it,
);
