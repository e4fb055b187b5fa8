//! Canary policies (docs/configuration.md `[routes.canary]`): a stable slice of a route's keys runs under a
//! candidate policy, its attempts carry the candidate's `policy_version`, and the canary ends
//! itself — a `canary_off` switch in the audit trail, obeyed at once — when a stop condition
//! holds. Every case runs on SQLite and PostgreSQL.

use std::time::{Duration, Instant};

use crate::common::{both_stores, send, Backend, Broker, Db, Reply, Upstream};

const BODY: &str = r#"{"amount":42}"#;

/// The route tries once; its canary, on half the keys, up to three times, and stops once its
/// amplification passes 1.5 over at least four settled requests. The upstream fails throughout,
/// so its circuit is kept closed.
const CANARY: &str = r#"
[routes.circuit]
failures = 1000
[routes.retry]
max_attempts = 1
base = "10ms"
cap = "20ms"
budget_min_per_sec = 1000
[routes.canary]
percent = 50
by = "key"
retry = { max_attempts = 3 }
[routes.canary.stop]
amplification_over = 1.5
min_requests = 4
"#;

/// A broker whose one route (at `/payments`) is named `route`: the canary gauges are the
/// process's, shared with the other tests, so each test's canary runs on a route of its own.
async fn start(b: Backend, upstream: &Upstream, route: &str, extra: &str) -> Broker {
    let db = Db::new(b).await;
    let text = crate::common::TestConfig::new(&upstream.url())
        .store(&db.url)
        .tables(extra)
        .text()
        .replace("name = \"payments\"", &format!("name = \"{route}\""));
    Broker::start_with(&db, text).await
}

/// The route's own policy version, as `/_idem/routes` gives it.
async fn control_version(broker: &Broker) -> String {
    let routes = send(broker.http.get(format!("{}/_idem/routes", broker.url))).await.json();
    routes["routes"][0]["policy_version"].as_str().unwrap().to_string()
}

/// The policy version a key's attempts ran under, and how many there were.
async fn ran(broker: &Broker, key: &str) -> (String, usize) {
    let record = broker.record_json(key).await;
    let attempts = record["attempts"].as_array().unwrap();
    (attempts[0]["policy_version"].as_str().unwrap().to_string(), attempts.len())
}

async fn a_canary_runs_its_slice_under_its_own_policy_and_stops_itself(b: Backend) {
    let upstream = Upstream::start().await;
    let route = format!("canary-runs-{b:?}");
    let broker = start(b, &upstream, &route, CANARY).await;
    let control = control_version(&broker).await;

    let mut canary_keys = Vec::new();
    for i in 0..16 {
        let key = format!("before-{i}");
        upstream.script(&key, vec![Reply::status(503); 3]);
        assert_eq!(send(broker.post("/payments", &key, BODY)).await.status, 503);
        let (version, attempts) = ran(&broker, &key).await;
        assert_eq!(upstream.hits(&key) as usize, attempts);
        if version == control {
            assert_eq!(attempts, 1, "{key}: the route's own policy tries once");
        } else {
            assert_eq!(attempts, 3, "{key}: the canary's policy tries three times");
            canary_keys.push((key, version));
        }
    }
    assert!((4..=12).contains(&canary_keys.len()), "{} of 16 keys in a 50% slice", canary_keys.len());
    let canary = canary_keys[0].1.clone();
    assert!(canary_keys.iter().all(|(_, v)| *v == canary), "one canary version");

    // Within a few looks the canary sees its amplification of 3 and ends itself.
    let deadline = Instant::now() + Duration::from_secs(20);
    let switch = loop {
        let listed = send(broker.http.get(format!("{}/admin/switches", broker.admin))).await.json();
        let found = listed["items"].as_array().unwrap().iter().find(|s| s["action"] == "canary_off").cloned();
        if let Some(switch) = found {
            break switch;
        }
        assert!(Instant::now() < deadline, "the canary never stopped: {listed:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(switch["scope"], route.as_str());
    assert_eq!(switch["actor"], "idem canary");
    let reason = switch["reason"].as_str().unwrap();
    assert!(reason.contains(&canary) && reason.contains("amplification 3.00 is over 1.5"), "{reason}");

    // From then on every key runs under the route's own policy, those of the slice included.
    for (key, _) in &canary_keys {
        let again = format!("{key}-after");
        upstream.script(&again, vec![Reply::status(503); 3]);
        send(broker.post("/payments", &again, BODY)).await;
        assert_eq!(ran(&broker, &again).await, (control.clone(), 1), "{again}");
    }
    let metrics = broker.metrics().await;
    assert!(
        metrics.contains(&format!("idem_canary_running{{route=\"{route}\",policy_version=\"{canary}\"}} 0")),
        "{metrics}"
    );
    assert!(metrics.contains(&format!("policy_version=\"{canary}\"")) && metrics.contains("idem_canary_amplification"));
}

async fn an_operator_can_end_a_canary_by_hand_and_resume_it(b: Backend) {
    let upstream = Upstream::start().await;
    // Stop conditions that cannot trip here: only the operator ends this canary.
    let config = CANARY.replace("min_requests = 4", "min_requests = 1000");
    let route = format!("canary-by-hand-{b:?}");
    let broker = start(b, &upstream, &route, &config).await;
    let control = control_version(&broker).await;
    /// Sends sixteen new keys; how many ran under the canary's policy.
    async fn in_canary(broker: &Broker, control: &str, prefix: &str) -> usize {
        let mut n = 0;
        for i in 0..16 {
            let key = format!("{prefix}-{i}");
            send(broker.post("/payments", &key, BODY)).await;
            n += usize::from(ran(broker, &key).await.0 != control);
        }
        n
    }
    assert!(in_canary(&broker, &control, "running").await > 0, "half the keys run the canary");

    let set = send(broker.http.post(format!("{}/admin/switches", broker.admin)).json(&serde_json::json!({
        "scope": route, "action": "canary_off", "reason": "pausing the trial", "actor": "alice"
    })))
    .await;
    assert_eq!(set.status, 201, "{:?}", set.body);
    assert_eq!(in_canary(&broker, &control, "paused").await, 0, "a paused canary runs nothing");

    let id = set.json()["id"].as_str().unwrap().to_string();
    let clear = broker.http.post(format!("{}/admin/switches/{id}/clear", broker.admin));
    let cleared = send(clear.json(&serde_json::json!({"reason": "resume", "actor": "alice"}))).await;
    assert_eq!(cleared.status, 200, "{:?}", cleared.body);
    assert!(in_canary(&broker, &control, "resumed").await > 0, "cleared, the canary runs again");
}

async fn a_canary_removed_by_a_reload_is_shown_as_ended(b: Backend) {
    let upstream = Upstream::start().await;
    let config = CANARY.replace("min_requests = 4", "min_requests = 1000");
    let route = format!("canary-reloaded-{b:?}");
    let broker = start(b, &upstream, &route, &config).await;
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config", broker.config_file.to_str().unwrap()])
        .output()
        .unwrap();
    let described = String::from_utf8_lossy(&checked.stdout).into_owned();
    let version = described.split("canary 50% by key, policy_version ").nth(1).expect(&described)[..12].to_string();
    let running = |on: u8| format!("idem_canary_running{{route=\"{route}\",policy_version=\"{version}\"}} {on}");
    broker.await_metric(&running(1)).await;

    let without = broker.config_text.split("[routes.canary]").next().unwrap().to_string();
    broker.write_config(&without);
    assert_eq!(broker.reload(None).await.status, 200);
    broker.await_metric(&running(0)).await;
}

both_stores!(
    a_canary_removed_by_a_reload_is_shown_as_ended,
    a_canary_runs_its_slice_under_its_own_policy_and_stops_itself,
    an_operator_can_end_a_canary_by_hand_and_resume_it,
);
