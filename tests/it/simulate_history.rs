//! `idem simulate --history` through the real binary: a real broker records requests against a
//! scripted upstream, then the CLI replays them from the same store, while the broker still
//! runs, through the current policy and candidates.

use std::io::Write;
use std::process::Output;
use std::time::Duration;

use crate::common::{Backend, Broker, Db, Reply, TestConfig, Upstream};
use serde_json::Value;

/// The broker's policy: three attempts, short waits, a deadline no test comes near. Without
/// jitter the replay waits exactly as the broker did, so no replayed attempt starts later than
/// its recorded one and nothing has to be assumed about it.
const RETRY: &str = "[routes.retry]\nmax_attempts = 3\ndeadline = \"20s\"\nper_try_timeout = \"5s\"\n\
                     base = \"10ms\"\ncap = \"20ms\"\njitter = \"none\"\n";

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("a temp file");
    file.write_all(text.as_bytes()).expect("written");
    file
}

async fn idem(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("simulate")
        .args(args)
        .output()
        .await
        .expect("idem runs")
}

/// The comparison of `candidate` against the broker's config, as JSON.
async fn history(config: &tempfile::NamedTempFile, candidate: &str, extra: &[&str]) -> Value {
    let candidate = file(candidate);
    let (config, candidate) = (config.path().to_str().unwrap(), candidate.path().to_str().unwrap());
    let mut args = vec![
        "--history",
        "--config",
        config,
        "--route",
        "payments",
        "--since",
        "1h",
        "--candidate",
        candidate,
        "--json",
    ];
    args.extend(extra);
    let out = idem(&args).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

fn figure(doc: &Value, column: &str, name: &str) -> Value {
    let figures = if column == "recorded" { &doc["recorded"] } else { &doc[column]["figures"] };
    figures[name].clone()
}

/// Three keys succeed at once, three after one 503, two never (503 three times).
async fn recorded_history(backend: Backend) -> (Broker, Upstream, tempfile::NamedTempFile) {
    let db = Db::new(backend).await;
    let upstream = Upstream::start().await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).tables(RETRY)).await;
    for key in ["salvaged-1", "salvaged-2", "salvaged-3"] {
        upstream.script(key, vec![Reply::status(503)]);
    }
    for key in ["failed-1", "failed-2"] {
        upstream.script(key, vec![Reply::status(503), Reply::status(503), Reply::status(503)]);
    }
    let keys = ["ok-1", "salvaged-1", "failed-1", "ok-2", "salvaged-2", "ok-3", "failed-2", "salvaged-3"];
    for key in keys {
        broker.post("/payments", key, "{}").send().await.unwrap();
        broker.await_record(key, Duration::from_secs(10), |r| !r["stop_reason"].is_null()).await;
    }
    let hits: u32 = keys.iter().map(|k| upstream.hits(k)).sum();
    assert_eq!(hits, 3 + 3 * 2 + 2 * 3, "the upstream saw every attempt");
    let config = file(&broker.config_text);
    (broker, upstream, config)
}

async fn the_current_policy_replays_what_was_recorded(backend: Backend) {
    let (broker, _upstream, config) = recorded_history(backend).await;
    let doc = history(&config, "[retry]\nmax_attempts = 3\n", &[]).await;
    for column in ["recorded", "current"] {
        assert_eq!(figure(&doc, column, "requests"), 8, "{column}: {doc:#}");
        assert_eq!(figure(&doc, column, "attempts"), 15, "{column}: {doc:#}");
        assert_eq!(figure(&doc, column, "final_success"), 6, "{column}: {doc:#}");
        assert_eq!(figure(&doc, column, "first_try_success"), 3, "{column}: {doc:#}");
        assert_eq!(figure(&doc, column, "retry_salvage"), 3, "{column}: {doc:#}");
    }
    assert_eq!(doc["current"]["unobserved_attempts"]["total"], 0, "{doc:#}");
    assert_eq!(doc["left_out"]["running"], 0);
    broker.stop().await;
}

async fn a_single_attempt_candidate_salvages_nothing(backend: Backend) {
    let (broker, _upstream, config) = recorded_history(backend).await;
    let doc = history(&config, "[retry]\nmax_attempts = 1\n", &[]).await;
    assert_eq!(figure(&doc, "candidate", "requests"), 8, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "attempts"), 8, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "amplification"), 1.0, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "retry_salvage"), 0, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "final_success"), 3, "{doc:#}");
    assert_eq!(figure(&doc, "current", "final_success"), 6, "{doc:#}");
    assert_eq!(doc["candidate"]["unobserved_attempts"]["total"], 0);
    broker.stop().await;
}

async fn more_attempts_than_recorded_follow_the_stated_assumption(backend: Backend) {
    let (broker, _upstream, config) = recorded_history(backend).await;
    // Two requests failed all three attempts: each gets two more, never observed.
    let doc = history(&config, "[retry]\nmax_attempts = 5\n", &[]).await;
    assert_eq!(figure(&doc, "candidate", "attempts"), 3 + 6 + 2 * 5, "{doc:#}");
    assert_eq!(doc["candidate"]["unobserved_attempts"]["beyond_recorded"], 4, "{doc:#}");
    assert_eq!(doc["assumption"]["name"], "last");
    assert_eq!(figure(&doc, "candidate", "final_success"), 6, "they meet the 503 last seen: {doc:#}");
    let doc = history(&config, "[retry]\nmax_attempts = 5\n", &["--unobserved", "success"]).await;
    assert_eq!(doc["candidate"]["unobserved_attempts"]["beyond_recorded"], 2, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "final_success"), 8, "the fourth attempt succeeds: {doc:#}");
    assert_eq!(figure(&doc, "candidate", "retry_salvage"), 5, "{doc:#}");
    broker.stop().await;
}

async fn the_table_shows_current_beside_candidate(backend: Backend) {
    let (broker, _upstream, config) = recorded_history(backend).await;
    let whole = format!(
        "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"http://127.0.0.1:9\"\n{}",
        RETRY.replace("max_attempts = 3", "max_attempts = 1")
    );
    let candidate = file(&whole);
    let out = idem(&[
        "--history",
        "--config",
        config.path().to_str().unwrap(),
        "--route",
        "payments",
        "--since",
        "1h",
        "--candidate",
        candidate.path().to_str().unwrap(),
    ])
    .await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("read as a whole config"), "{text}");
    let row = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row: {text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(row("amplification"), "amplification 1.88 1.88 1.00", "{text}");
    assert_eq!(row("physical attempts"), "physical attempts 15 15 8", "{text}");
    assert!(text.contains("assumption (last)"), "{text}");
    broker.stop().await;
}

async fn a_recorded_retry_after_holds_in_the_replay(backend: Backend) {
    let db = Db::new(backend).await;
    let upstream = Upstream::start().await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).tables(RETRY)).await;
    upstream.script("later", vec![Reply::status(503).header("retry-after", "1")]);
    broker.post("/payments", "later", "{}").send().await.unwrap();
    let record = broker.await_record("later", Duration::from_secs(10), |r| !r["stop_reason"].is_null()).await;
    assert_eq!(record["attempts"][0]["retry_after_ms"], 1000, "{record:#}");
    assert_eq!(record["stop_reason"], "success");
    let config = file(&broker.config_text);
    // A second's Retry-After does not fit in a one-second deadline: never shortened, it stops.
    let doc = history(&config, "[retry]\ndeadline = \"1s\"\n", &[]).await;
    assert_eq!(figure(&doc, "current", "retry_salvage"), 1, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "stop_reasons")["retry_after_beyond_deadline"], 1, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "final_success"), 0, "{doc:#}");
    broker.stop().await;
}

/// A candidate that gives the tenant a quota of one retry a window: the first request that
/// needed a retry gets it, every later one stops on the tenant's quota.
async fn a_candidate_tenant_quota_stops_retries_the_route_would_allow(backend: Backend) {
    let (broker, _upstream, config) = recorded_history(backend).await;
    let candidate = "[tenants.default]\nretry_budget_ratio = 0.0\nretry_budget_min_per_sec = 0.1\n";
    let doc = history(&config, candidate, &[]).await;
    assert_eq!(figure(&doc, "current", "final_success"), 6, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "final_success"), 4, "ok-1..3 and salvaged-1: {doc:#}");
    assert_eq!(figure(&doc, "candidate", "budget_stopped"), 4, "{doc:#}");
    assert_eq!(figure(&doc, "candidate", "stop_reasons")["tenant_budget"], 4, "{doc:#}");
    assert_eq!(doc["current"]["tenant_quotas"]["default"], Value::Null, "no quota today: {doc:#}");
    assert_eq!(doc["candidate"]["tenant_quotas"]["default"]["retry_budget_min_per_sec"], 0.1, "{doc:#}");
    broker.stop().await;
}

crate::common::both_stores!(
    a_candidate_tenant_quota_stops_retries_the_route_would_allow,
    a_recorded_retry_after_holds_in_the_replay,
    the_current_policy_replays_what_was_recorded,
    a_single_attempt_candidate_salvages_nothing,
    more_attempts_than_recorded_follow_the_stated_assumption,
    the_table_shows_current_beside_candidate,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_the_problem_named() {
    let (broker, _upstream, config) = recorded_history(Backend::Sqlite).await;
    let config = config.path().to_str().unwrap().to_string();
    let good = file("[retry]\nmax_attempts = 1\n");
    let invalid = file("[retry]\nmax_attempts = 0\n");
    let other_routes = file("[[routes]]\nname = \"orders\"\npath_prefix = \"/o\"\nupstream = \"http://127.0.0.1:9\"\n");
    let path = |f: &tempfile::NamedTempFile| f.path().to_str().unwrap().to_string();
    let cases: [(&str, &str, String, &str); 5] = [
        ("orders", "1h", path(&good), "no route named `orders` in the config (routes: payments)"),
        ("payments", "yesterday", path(&good), "--since `yesterday` is neither a duration"),
        (
            "payments",
            "1h",
            "/nonexistent/candidate.toml".into(),
            "cannot read the candidate /nonexistent/candidate.toml",
        ),
        ("payments", "1h", path(&invalid), "config key `retry.max_attempts`: must be at least 1"),
        ("payments", "1h", path(&other_routes), "config key `routes`: no route named `payments` (routes: orders)"),
    ];
    for (route, since, candidate, expected) in cases {
        let out =
            idem(&["--history", "--config", &config, "--route", route, "--since", since, "--candidate", &candidate])
                .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{route} {since} {candidate}: should fail");
        assert!(stderr.contains(expected), "{route} {since} {candidate}: {stderr}");
        assert!(out.stdout.is_empty());
    }
    broker.stop().await;
}
