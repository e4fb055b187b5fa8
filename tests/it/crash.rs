//! Crashes of a real `idem serve` process (docs/concepts.md, take-over): SIGKILL in the middle of an
//! attempt, in the middle of a backoff wait, at random moments under load, and SIGTERM's
//! graceful hand-back. The fake upstream runs in the test process and outlives every broker.

use crate::common::process::{await_until, history_entries, kill_loop, node_config, KillLoop, Node, LEASE};
use crate::common::{both_stores, Backend, Db, Reply, TestConfig, Upstream};

use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BODY: &str = r#"{"amount":42}"#;

/// A broker process on a fresh database in front of a fake upstream in this process.
struct Rig {
    upstream: Upstream,
    node: Node,
    db: Db,
}

/// `[server] drain` by default: how long a SIGTERM lets attempts in flight finish.
const DRAIN: Duration = Duration::from_secs(10);

async fn rig(b: Backend, route_extra: &str, extra: &str) -> Rig {
    rig_with(b, TestConfig::default().route(route_extra).tables(extra)).await
}

/// A node on `config`, with its upstream and database.
async fn rig_with(b: Backend, config: TestConfig) -> Rig {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let node = Node::start("broker", &node_config(&db.url, config.upstream(&upstream.url())).body()).await;
    Rig { upstream, node, db }
}

/// Out of `in_progress` and the queue: done, unknown or free.
fn settled(record: &Value) -> bool {
    !(record["state"] == "in_progress" || record["queued"] == true)
}

/// Started with `Prefer: respond-async`, so no client connection ties the execution to the
/// process that is about to die.
async fn submit(node: &Node, key: &str) {
    let r = node.post("/payments", key, BODY).header("prefer", "respond-async").send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
}

async fn a_kill_during_an_unsafe_attempt_makes_the_record_unknown_and_never_sends_it_again(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "").await;
    rig.upstream.script("held", vec![Reply::status(201).delay(Duration::from_secs(3))]);
    submit(&rig.node, "held").await;
    await_until("the upstream to receive the attempt", Duration::from_secs(10), || rig.upstream.hits("held") == 1)
        .await;
    let arrived = rig.upstream.arrivals("held")[0];

    rig.node.kill();
    rig.node.restart().await;

    let record = rig.node.await_record("held", 5 * LEASE + Duration::from_secs(5), settled).await;
    assert_eq!(record["state"], "unknown", "{record:#}");
    assert_eq!(record["stop_reason"], "unsafe_replay", "{record:#}");
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{record:#}");
    assert_eq!(attempts[0]["number"], 1);
    assert_eq!(attempts[0]["outcome"], "lost", "{record:#}");
    let take_overs = history_entries(&record, "take-over");
    assert_eq!(take_overs.len(), 1, "{record:#}");
    assert!(take_overs[0]["action"].as_str().unwrap().contains("unknown"), "{record:#}");

    // Past the upstream's own (unseen) answer and several leases: still one execution.
    let quiet_until = arrived + Duration::from_secs(3) + 4 * LEASE;
    tokio::time::sleep(quiet_until.saturating_duration_since(Instant::now())).await;
    assert_eq!(rig.upstream.hits("held"), 1, "an attempt that may have executed was sent again");
    let r = crate::common::send(rig.node.post("/payments", "held", BODY)).await;
    r.assert_problem(502, "outcome-unknown");
    assert_eq!(rig.upstream.hits("held"), 1);
    assert_eq!(rig.node.record("held").await.unwrap()["state"], "unknown");
}

async fn a_kill_during_an_attempt_on_a_replay_safe_route_sends_it_again_after_the_lease(b: Backend) {
    let mut rig = rig(b, "replay_safe = true", "").await;
    rig.upstream.script("safe", vec![Reply::status(201).delay(Duration::from_secs(3)), Reply::status(201)]);
    submit(&rig.node, "safe").await;
    await_until("the upstream to receive the attempt", Duration::from_secs(10), || rig.upstream.hits("safe") == 1)
        .await;

    rig.node.kill();
    rig.node.restart().await;

    let record = rig.node.await_record("safe", 5 * LEASE + Duration::from_secs(5), settled).await;
    assert_eq!(record["state"], "done", "a replay-safe record is continued: {record:#}");
    let outcomes: Vec<&Value> = record["attempts"].as_array().unwrap().iter().map(|a| &a["outcome"]).collect();
    assert_eq!(outcomes, [&json!("lost"), &json!("success")], "{record:#}");
    let take_overs = history_entries(&record, "take-over");
    assert_eq!(take_overs.len(), 1, "{record:#}");
    assert!(take_overs[0]["action"].as_str().unwrap().contains("queued"), "{record:#}");
    assert_eq!(rig.upstream.hits("safe"), 2);
}

async fn a_kill_during_a_backoff_wait_continues_the_record_and_keeps_the_wait(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "[routes.retry]\nbase = \"10ms\"\ncap = \"50ms\"\n").await;
    rig.upstream.script("waiting", vec![Reply::status(503).header("retry-after", "2"), Reply::status(201)]);
    submit(&rig.node, "waiting").await;
    // The first attempt's outcome is stored (so nothing is in flight): the record waits.
    rig.node
        .await_record("waiting", Duration::from_secs(10), |r| {
            r["state"] == "in_progress" && r["attempts"].as_array().is_some_and(|a| a.len() == 1)
        })
        .await;

    rig.node.kill();
    let killed = Instant::now();
    rig.node.restart().await;

    let record = rig.node.await_record("waiting", Duration::from_secs(15), settled).await;
    assert_eq!(record["state"], "done", "the record was not continued: {record:#}");
    assert_eq!(record["response"]["status"], 201, "{record:#}");
    assert_eq!(record["stop_reason"], "success");
    let take_overs = history_entries(&record, "take-over");
    assert_eq!(take_overs.len(), 1, "{record:#}");
    assert!(take_overs[0]["action"].as_str().unwrap().contains("queued"), "{record:#}");

    let arrivals = rig.upstream.arrivals("waiting");
    assert_eq!(arrivals.len(), 2, "{record:#}");
    let gap = arrivals[1] - arrivals[0];
    assert!(gap >= Duration::from_secs(2), "the Retry-After wait was cut short by the take-over: {gap:?}");
    assert!(arrivals[1] > killed, "the second attempt came from the restarted process");
    let replay = crate::common::send(rig.node.post("/payments", "waiting", BODY)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(rig.upstream.hits("waiting"), 2);
    // The record tells the operator about that wait, as it does when no take-over intervenes.
    let waited = record["attempts"][1]["wait_ms"].as_u64().unwrap();
    assert!(waited >= 1900, "attempt 2 followed a 2 s wait, yet its record says wait_ms = {waited}: {record:#}");
}

async fn a_record_whose_broker_keeps_dying_on_it_stops_after_max_takeovers_instead_of_looping(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let config = node_config(
        &db.url,
        TestConfig::new(&upstream.url()).worker("max_takeovers = 1\n").route("replay_safe = true"),
    )
    .body();
    let mut node = Node::start("broker", &config).await;
    // Every attempt is still in flight when the process dies: on a replay-safe route, each
    // take-over sends it again.
    upstream.script("poison", vec![Reply::status(201).delay(Duration::from_secs(60)); 3]);
    submit(&node, "poison").await;
    for attempt in 1..=2 {
        await_until("the upstream to receive the attempt", Duration::from_secs(15), || {
            upstream.hits("poison") == attempt
        })
        .await;
        node.kill();
        node.restart().await;
    }

    // The first take-over continued it; the second is past the cap and stops it.
    let record = node.await_record("poison", 5 * LEASE + Duration::from_secs(5), settled).await;
    assert_eq!(record["state"], "unknown", "attempts may have run: {record:#}");
    assert_eq!(record["stop_reason"], "takeover_cap", "{record:#}");
    assert_eq!(record["takeovers"], 2, "{record:#}");
    let take_overs = history_entries(&record, "take-over");
    assert_eq!(take_overs.len(), 2, "{record:#}");
    assert!(take_overs[0]["action"].as_str().unwrap().contains("queued"), "{record:#}");
    assert!(take_overs[1]["action"].as_str().unwrap().contains("unknown"), "{record:#}");
    assert!(take_overs[1]["note"].as_str().unwrap().contains("max_takeovers"), "{record:#}");

    // Not sent again, by a take-over or by the client's retry.
    let r = crate::common::send(node.post("/payments", "poison", BODY)).await;
    r.assert_problem(502, "outcome-unknown");
    let quiet_until = Instant::now() + 3 * LEASE;
    while Instant::now() < quiet_until {
        assert_eq!(upstream.hits("poison"), 2, "a record past the take-over cap was sent again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn sigkill_at_random_moments_loses_no_acknowledged_request_and_executes_none_twice(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "").await;
    // The keys start 33 ms apart, so requests are in every stage when the kills come.
    let plan = KillLoop {
        name: format!("kill loop ({b:?})"),
        prefix: "loop",
        keys: 300,
        kills: 5,
        spacing: Duration::from_millis(33),
        upstream_delay_ms: 120,
        down_ms: 300,
    };
    kill_loop(plan, std::slice::from_mut(&mut rig.node), &rig.upstream).await;
}

async fn sigterm_hands_a_waiting_record_back_and_it_completes_after_the_restart(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "[routes.retry]\nbase = \"10ms\"\ncap = \"50ms\"\n").await;
    rig.upstream.script("graceful", vec![Reply::status(503).header("retry-after", "3"), Reply::status(201)]);
    submit(&rig.node, "graceful").await;
    rig.node
        .await_record("graceful", Duration::from_secs(10), |r| {
            r["state"] == "in_progress" && r["attempts"].as_array().is_some_and(|a| a.len() == 1)
        })
        .await;

    let asked = Instant::now();
    rig.node.terminate();
    let status = rig.node.wait_exit(DRAIN).await;
    let took = asked.elapsed();
    let status = status.unwrap_or_else(|| panic!("still running {took:?} after SIGTERM:\n{}", rig.node.log_tail(40)));
    assert!(status.success(), "exited with {status} after SIGTERM:\n{}", rig.node.log_tail(40));

    // Read straight from the store while no broker runs: handed back, not left to its lease.
    {
        let store = idem::store::open(&rig.db.url).await.unwrap();
        let key = idem::domain::key::IdempotencyKey::parse("graceful").unwrap();
        let record = store.lookup(&Default::default(), &key).await.unwrap().expect("the record is kept");
        assert_eq!(record.phase(), idem::domain::Phase::Queued, "{record:?}");
        assert!(record.lease.is_none(), "{record:?}");
        assert!(record.in_flight.is_none(), "{record:?}");
        assert_eq!(record.attempts.len(), 1);
    }

    rig.node.restart().await;
    let record = rig.node.await_record("graceful", Duration::from_secs(15), settled).await;
    assert_eq!(record["state"], "done", "{record:#}");
    assert_eq!(record["response"]["status"], 201);
    assert!(history_entries(&record, "take-over").is_empty(), "it was taken over, not handed back: {record:#}");
    let arrivals = rig.upstream.arrivals("graceful");
    assert_eq!(arrivals.len(), 2);
    let gap = arrivals[1] - arrivals[0];
    assert!(gap >= Duration::from_secs(3), "the Retry-After wait was cut short by the restart: {gap:?}");
}

async fn sigterm_lets_an_attempt_in_flight_finish_and_answers_its_client(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "").await;
    rig.upstream.script("finishing", vec![Reply::status(201).delay(Duration::from_secs(2))]);
    let request = rig.node.post("/payments", "finishing", BODY);
    let client = tokio::spawn(async move {
        let r = request.send().await?;
        let status = r.status().as_u16();
        r.bytes().await.map(|body| (status, body))
    });
    await_until("the upstream to receive the attempt", Duration::from_secs(10), || rig.upstream.hits("finishing") == 1)
        .await;

    let asked = Instant::now();
    rig.node.terminate();
    let status = rig.node.wait_exit(DRAIN).await;
    let took = asked.elapsed();
    let status = status.unwrap_or_else(|| panic!("still running {took:?} after SIGTERM"));
    assert!(status.success(), "exited with {status} after SIGTERM");
    let (code, body) = client.await.unwrap().expect("the client's answer went out before the exit");
    assert_eq!(code, 201, "{body:?}");

    rig.node.restart().await;
    let record = rig.node.record("finishing").await.unwrap();
    assert_eq!(record["state"], "done", "{record:#}");
    assert_eq!(record["response"]["body"], Value::String(String::from_utf8_lossy(&body).into_owned()));
    assert!(history_entries(&record, "take-over").is_empty(), "{record:#}");
    assert_eq!(rig.upstream.hits("finishing"), 1);
}

async fn sigterm_answers_a_client_waiting_on_a_handed_back_record_instead_of_holding_the_shutdown(b: Backend) {
    let mut rig = rig(b, "replay_safe = false", "[routes.retry]\nbase = \"10ms\"\ncap = \"50ms\"\n").await;
    rig.upstream.script("awaited", vec![Reply::status(503).header("retry-after", "3"), Reply::status(201)]);
    submit(&rig.node, "awaited").await;
    rig.node
        .await_record("awaited", Duration::from_secs(10), |r| {
            r["state"] == "in_progress" && r["attempts"].as_array().is_some_and(|a| a.len() == 1)
        })
        .await;
    // A duplicate that prefers to wait a minute for the outcome; a local request arrives in far
    // less than the pause before the signal.
    let request = rig.node.post("/payments", "awaited", BODY).header("prefer", "wait=60");
    let waiter = tokio::spawn(async move {
        let r = request.send().await?;
        let status = r.status().as_u16();
        r.bytes().await.map(|body| (status, body))
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let asked = Instant::now();
    rig.node.terminate();
    let status = rig.node.wait_exit(DRAIN + Duration::from_secs(5)).await;
    let took = asked.elapsed();
    let answer = waiter.await.unwrap();
    assert!(status.is_some(), "still running {took:?} after SIGTERM");

    // Nothing is in flight: there is nothing to wait for, and the waiting client can be told to
    // come back (409 request-in-progress, or 503) instead of having its connection cut.
    match answer {
        Ok((status, body)) => {
            assert!(matches!(status, 409 | 503), "the waiting client got {status} {body:?}")
        }
        Err(e) => panic!("the waiting client got no answer ({e}); the broker took {took:?} to exit after SIGTERM"),
    }
    assert!(took < DRAIN, "the broker took {took:?} to exit after SIGTERM");
}

async fn sigterm_waits_no_longer_than_the_configured_drain(b: Backend) {
    let mut rig = rig_with(b, TestConfig::default().server("drain = \"1s\"").route("replay_safe = false")).await;
    rig.upstream.script("slow", vec![Reply::status(201).delay(Duration::from_secs(6))]);
    submit(&rig.node, "slow").await;
    await_until("the upstream to receive the attempt", Duration::from_secs(10), || rig.upstream.hits("slow") == 1)
        .await;

    let asked = Instant::now();
    rig.node.terminate();
    let status = rig.node.wait_exit(DRAIN).await;
    let took = asked.elapsed();
    assert!(status.is_some(), "still running {took:?} after SIGTERM:\n{}", rig.node.log_tail(40));
    // The default drain would have waited for the answer, six seconds on.
    assert!(took < Duration::from_secs(4), "the broker took {took:?} to exit with a drain of 1s");
    assert!(took >= Duration::from_secs(1), "the broker left after {took:?}, before its drain of 1s");
}

/// SIGTERM with `[server] drain_readiness`: `/readyz` fails at once, saying the node drains,
/// while new requests are still served, for that long; only then do the listeners close, the
/// drain run and the process exit. A load balancer stops sending before anything is refused.
async fn sigterm_fails_readiness_first_while_still_serving(b: Backend) {
    let readiness = Duration::from_millis(1_500);
    let mut rig = rig_with(b, TestConfig::default().server("drain_readiness = \"1500ms\"")).await;
    let ready = |node: &Node| node.http.get(format!("{}/readyz", node.admin)).send();
    assert_eq!(ready(&rig.node).await.unwrap().status(), 200);

    let asked = Instant::now();
    rig.node.terminate();
    loop {
        let answer = ready(&rig.node).await.unwrap();
        if answer.status() == 503 {
            assert!(answer.text().await.unwrap().contains("draining"));
            break;
        }
        assert!(asked.elapsed() < readiness / 2, "/readyz still ready {:?} after SIGTERM", asked.elapsed());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let served = rig.node.post("/payments", "after-sigterm", BODY).send().await.unwrap();
    assert_eq!(served.status(), 201, "still served while leaving");
    assert!(asked.elapsed() < readiness, "the request came within the readiness phase");

    let status = rig.node.wait_exit(DRAIN).await.expect("exited after the readiness phase and the drain");
    assert!(status.success(), "{status}");
    assert!(asked.elapsed() >= readiness, "not before its readiness phase: {:?}", asked.elapsed());
}

both_stores!(
    sigterm_fails_readiness_first_while_still_serving,
    sigterm_waits_no_longer_than_the_configured_drain,
    a_kill_during_an_unsafe_attempt_makes_the_record_unknown_and_never_sends_it_again,
    a_kill_during_an_attempt_on_a_replay_safe_route_sends_it_again_after_the_lease,
    a_kill_during_a_backoff_wait_continues_the_record_and_keeps_the_wait,
    a_record_whose_broker_keeps_dying_on_it_stops_after_max_takeovers_instead_of_looping,
    sigkill_at_random_moments_loses_no_acknowledged_request_and_executes_none_twice,
    sigterm_hands_a_waiting_record_back_and_it_completes_after_the_restart,
    sigterm_lets_an_attempt_in_flight_finish_and_answers_its_client,
    sigterm_answers_a_client_waiting_on_a_handed_back_record_instead_of_holding_the_shutdown,
);
