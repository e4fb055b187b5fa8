//! `/admin/stats` after a retry storm: an upstream that answers 503 to most first attempts on
//! one route, a healthy second route beside it. The curves must say what was driven, on both
//! stores, and say it again from a broker started afresh on the same database.

use std::time::{Duration, Instant};

use crate::common::{both_stores, send, Backend, Broker, Db, Reply, TestConfig, Upstream};
use idem::domain::Timestamp;
use idem::store::stats::{AnswerCount, Answers, StatsSpan};
use idem::store::AddAnswerCounts;
use serde_json::Value;

both_stores!(
    the_stats_draw_the_storm_on_one_route_and_calm_on_the_other,
    windows_steps_and_routes_that_cannot_be_drawn_are_refused,
    answer_counts_from_several_nodes_add_up_and_old_ones_are_forgotten
);

/// `payments` retries at most twice, within a retry budget of 10 retries per 10 s (no share of
/// first attempts), under a 1 s deadline that refuses to start an attempt with less than 400 ms
/// left; the circuit breaker is kept out of the way. `ledger` is the healthy route.
fn routes(upstream: &str) -> String {
    format!(
        r#"
[routes.retry]
max_attempts = 3
base = "10ms"
cap = "20ms"
deadline = "1s"
per_try_timeout = "1s"
min_try = "400ms"
budget_ratio = 0.0
budget_min_per_sec = 1.0

[routes.circuit]
failures = 1000

[[routes]]
name = "ledger"
path_prefix = "/ledger"
upstream = "{upstream}"
"#
    )
}

async fn stats(broker: &Broker, query: &str) -> reqwest::Response {
    broker.http.get(format!("{}/admin/stats{query}", broker.admin)).send().await.unwrap()
}

async fn stats_json(broker: &Broker, query: &str) -> Value {
    let r = stats(broker, query).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn route<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["routes"].as_array().unwrap().iter().find(|r| r["route"] == name).unwrap_or_else(|| panic!("{stats:#}"))
}

fn close(value: &Value, expected: f64) -> bool {
    value.as_f64().is_some_and(|v| (v - expected).abs() < 1e-3)
}

async fn the_stats_draw_the_storm_on_one_route_and_calm_on_the_other(backend: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(backend).await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).tables(&routes(&upstream.url()))).await;
    let body = r#"{"amount":1}"#;

    // payments, one request at a time: one answer arrives too late to leave room for a retry,
    // one may have executed (504: unknown), four succeed at once, and sixteen get a 503 first.
    // The budget lets the first ten of those retry (and succeed); the other six stop there.
    upstream.script("late", vec![Reply::status(503).delay(Duration::from_millis(700))]);
    upstream.script("lost", vec![Reply::status(504)]);
    assert_eq!(send(broker.post("/payments", "late", body)).await.status, 503);
    send(broker.post("/payments", "lost", body)).await.assert_problem(502, "outcome-unknown");
    for i in 0..4 {
        assert_eq!(send(broker.post("/payments", &format!("ok-{i}"), body)).await.status, 201);
    }
    let mut salvaged = 0;
    for i in 0..16 {
        let key = format!("storm-{i}");
        upstream.script(&key, vec![Reply::status(503)]);
        if send(broker.post("/payments", &key, body)).await.status == 201 {
            salvaged += 1;
        }
    }
    assert_eq!(salvaged, 10, "the budget allows ten retries");
    for _ in 0..3 {
        assert_eq!(send(broker.post("/payments", "ok-0", body)).await.header("idempotent-replayed"), Some("true"));
    }

    // ledger: every request succeeds at once; two replays, and a duplicate while one runs: 409.
    for i in 0..10 {
        assert_eq!(send(broker.post("/ledger", &format!("ledger-{i}"), body)).await.status, 201);
    }
    for _ in 0..2 {
        send(broker.post("/ledger", "ledger-0", body)).await;
    }
    let slow = tokio::spawn(send(broker.post("/ledger?delay_ms=600", "ledger-slow", body)));
    upstream.await_hits("ledger-slow", 1).await;
    send(broker.post("/ledger?delay_ms=600", "ledger-slow", body)).await.assert_problem(409, "request-in-progress");
    assert_eq!(slow.await.unwrap().status, 201);

    // Replays and 409s reach the store within a second or so.
    let until = Instant::now() + Duration::from_secs(15);
    let stats = loop {
        let stats = stats_json(&broker, "?window=1h&step=10s").await;
        let counted = |r: &str, curve: &str| route(&stats, r)["totals"][curve].clone();
        if counted("payments", "replays") == 3 && counted("ledger", "conflicts") == 1 {
            break stats;
        }
        assert!(Instant::now() < until, "replays and 409s never showed: {stats:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(stats["step_ms"], 10_000);
    assert_eq!(stats["points"], 360);
    let names: Vec<&Value> = stats["routes"].as_array().unwrap().iter().map(|r| &r["route"]).collect();
    assert_eq!(names, ["payments", "ledger"], "every configured route, in config order");

    let storm = &route(&stats, "payments")["totals"];
    assert_eq!(storm["requests"], 22, "{storm:#}");
    assert_eq!(storm["attempts"], 1 + 1 + 4 + 16 + 10, "{storm:#}");
    assert!(close(&storm["amplification"], 32.0 / 22.0), "{storm:#}");
    assert!(close(&storm["first_try_success"], 4.0 / 22.0), "{storm:#}");
    assert!(close(&storm["final_success"], 14.0 / 22.0), "{storm:#}");
    assert_eq!(storm["retry_salvaged"], 10);
    assert_eq!(storm["budget_stopped"], 6);
    assert_eq!(storm["deadline_stopped"], 1);
    assert_eq!(storm["replays"], 3);
    assert_eq!(storm["conflicts"], 0);
    assert_eq!(storm["unknown_depth"], 1);
    let (p50, p99) = (storm["p50_ms"].as_u64().unwrap(), storm["p99_ms"].as_u64().unwrap());
    assert!(p50 < 700 && p99 >= 700, "the late answer is the slowest: p50 {p50}, p99 {p99}");

    let calm = &route(&stats, "ledger")["totals"];
    assert_eq!((calm["requests"].clone(), calm["attempts"].clone()), (11.into(), 11.into()), "{calm:#}");
    assert!(close(&calm["amplification"], 1.0), "{calm:#}");
    assert!(close(&calm["first_try_success"], 1.0) && close(&calm["final_success"], 1.0), "{calm:#}");
    for curve in ["retry_salvaged", "budget_stopped", "deadline_stopped", "unknown_depth"] {
        assert_eq!(calm[curve], 0, "{curve}: {calm:#}");
    }
    assert_eq!((calm["replays"].clone(), calm["conflicts"].clone()), (2.into(), 1.into()));

    // The series hold the same figures, step by step: their sums are the totals, and every
    // step's amplification is at least 1 on the storm route and exactly 1 on the calm one.
    for (name, lowest) in [("payments", 1.0), ("ledger", 1.0)] {
        let r = route(&stats, name);
        for curve in ["requests", "attempts", "retry_salvaged", "budget_stopped", "replays", "conflicts"] {
            let points = r["series"][curve].as_array().unwrap();
            assert_eq!(points.len(), 360);
            assert_eq!(points.iter().map(|p| p.as_u64().unwrap()).sum::<u64>(), r["totals"][curve], "{name} {curve}");
        }
        let amplification: Vec<f64> =
            r["series"]["amplification"].as_array().unwrap().iter().filter_map(Value::as_f64).collect();
        assert!(!amplification.is_empty() && amplification.iter().all(|a| *a >= lowest), "{name}: {amplification:?}");
    }
    assert!(route(&stats, "ledger")["series"]["amplification"]
        .as_array()
        .unwrap()
        .iter()
        .all(|a| a.is_null() || close(a, 1.0)));
    assert_eq!(route(&stats, "payments")["series"]["unknown_depth"].as_array().unwrap().last().unwrap(), 1);

    // One route alone.
    let ledger_only = stats_json(&broker, "?window=1h&step=10s&route=ledger").await;
    assert_eq!(ledger_only["routes"].as_array().unwrap().len(), 1);
    assert_eq!(route(&ledger_only, "ledger")["totals"], *calm);

    // The figures live in the store: a broker started afresh on it answers the same.
    broker.stop().await;
    let again = Broker::start(&db, TestConfig::new(&upstream.url()).tables(&routes(&upstream.url()))).await;
    let restarted = stats_json(&again, "?window=1h&step=10s").await;
    for name in ["payments", "ledger"] {
        assert_eq!(route(&restarted, name)["totals"], route(&stats, name)["totals"], "{name}");
    }
    again.stop().await;
}

async fn windows_steps_and_routes_that_cannot_be_drawn_are_refused(backend: Backend) {
    let upstream = Upstream::start().await;
    let broker = Broker::start(&Db::new(backend).await, TestConfig::new(&upstream.url())).await;
    for (query, problem) in [
        ("?window=8d", "invalid-window"),
        ("?window=soon", "invalid-window"),
        ("?window=1h&step=500ms", "invalid-step"),
        ("?window=1h&step=1s", "invalid-step"),
        ("?window=1h&step=ten", "invalid-step"),
    ] {
        let answer = crate::common::Answer::of(stats(&broker, query).await).await;
        answer.assert_problem(400, problem);
        let name = problem.trim_start_matches("invalid-");
        assert!(answer.json()["detail"].as_str().unwrap().contains(&format!("`{name}`")), "{query}");
    }
    crate::common::Answer::of(stats(&broker, "?route=nope").await).await.assert_problem(404, "route-not-found");
    // Nothing happened yet: zeros and gaps, never an error.
    let quiet = stats_json(&broker, "?window=5m&step=1m").await;
    let payments = route(&quiet, "payments");
    assert_eq!(payments["series"]["requests"], serde_json::json!([0, 0, 0, 0, 0]));
    assert_eq!(payments["series"]["amplification"], serde_json::json!([null, null, null, null, null]));
    assert_eq!(payments["totals"]["p99_ms"], Value::Null);
    broker.stop().await;
}

async fn answer_counts_from_several_nodes_add_up_and_old_ones_are_forgotten(backend: Backend) {
    let db = Db::new(backend).await;
    let store = db.store().await;
    let at = Timestamp::from_millis;
    let count = |route: &str, second: i64, replays: u64, conflicts: u64| AnswerCount {
        route: route.into(),
        second: at(second),
        replays,
        conflicts,
    };
    // Two nodes count the same second of the same route; a third second, long ago, is forgotten
    // by a later flush.
    store
        .add_answer_counts(AddAnswerCounts {
            counts: vec![count("payments", 10_000, 5, 1), count("ledger", 12_000, 2, 0)],
            forget_before: at(0),
        })
        .await
        .unwrap();
    store
        .add_answer_counts(AddAnswerCounts { counts: vec![count("payments", 10_000, 7, 0)], forget_before: at(0) })
        .await
        .unwrap();
    store
        .add_answer_counts(AddAnswerCounts { counts: vec![count("payments", 1_000, 1, 1)], forget_before: at(0) })
        .await
        .unwrap();
    store
        .add_answer_counts(AddAnswerCounts { counts: vec![count("payments", 11_000, 1, 0)], forget_before: at(5_000) })
        .await
        .unwrap();

    let span = StatsSpan { start: at(0), end: at(20_000), step: Duration::from_secs(10), route: None };
    let mut answers = store.stats(&span).await.unwrap().answers;
    answers.sort_by(|a, b| (a.step, &a.route).cmp(&(b.step, &b.route)));
    let answer = |route: &str, step, replays, conflicts| Answers { route: route.into(), step, replays, conflicts };
    assert_eq!(answers, [answer("ledger", 1, 2, 0), answer("payments", 1, 13, 1)]);
    let one_route = StatsSpan { route: Some("ledger".into()), ..span };
    assert_eq!(store.stats(&one_route).await.unwrap().answers, [answer("ledger", 1, 2, 0)]);
}
