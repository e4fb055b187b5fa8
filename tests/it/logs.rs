//! Logs: JSON on request, one span per logical request with its executions and attempts
//! beneath it, and never a body, a credential or a cookie; plain text without terminal colours
//! when they go to a file or a pipe; one line for a request its first attempt answered.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::Upstream;

/// What a broker logs in `format` while it answers one keyed request, read from a pipe.
async fn logs_of_one_request(format: &str) -> String {
    let upstream = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let port = |_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (listen, admin) = (port(0), port(1));
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
             [store]\nurl = \"sqlite://{}\"\n\
             [[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"{}\"\n",
            dir.path().join("idem.db").display(),
            upstream.url()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--log-format", format, "serve", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while http.get(format!("http://127.0.0.1:{admin}/readyz")).send().await.is_err() {
        assert!(Instant::now() < until, "the broker did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = http
        .post(format!("http://127.0.0.1:{listen}/payments"))
        .header("idempotency-key", "logged-key")
        .header("authorization", "Bearer TOP-SECRET-TOKEN")
        .header("cookie", "session=COOKIE-SECRET")
        .body(r#"{"card":"SECRET-BODY-4242"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.kill().unwrap();
    let mut logs = String::new();
    child.stderr.take().unwrap().read_to_string(&mut logs).unwrap();
    child.wait().unwrap();
    logs
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_carry_request_and_attempt_spans_and_no_secrets() {
    let logs = logs_of_one_request("json").await;

    let events: Vec<serde_json::Value> =
        logs.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}"))).collect();
    let attempt = events
        .iter()
        .find(|e| e["fields"]["message"] == "attempt")
        .unwrap_or_else(|| panic!("no attempt event in {logs}"));
    assert_eq!(attempt["fields"]["outcome"], "success");
    let spans = attempt["spans"].as_array().unwrap();
    let names: Vec<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["request", "execution", "attempt"], "{attempt}");
    assert_eq!(spans[0]["tenant"], "default");
    assert_eq!(spans[1]["key"], "logged-key");
    assert_eq!(spans[1]["route"], "payments");
    assert!(spans[1]["record"].as_str().is_some_and(|id| id.len() == 36));
    assert_eq!(spans[2]["number"], 1);
    for secret in ["SECRET-BODY", "TOP-SECRET-TOKEN", "COOKIE-SECRET"] {
        assert!(!logs.contains(secret), "{secret} was logged");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn text_logs_to_a_pipe_carry_no_terminal_colour_codes() {
    let logs = logs_of_one_request("text").await;
    let attempt = logs.lines().find(|l| l.contains(" attempt ")).unwrap_or_else(|| panic!("no attempt line in {logs}"));
    assert!(attempt.contains("key=logged-key") && attempt.contains("outcome=\"success\""), "{attempt}");
    assert!(!logs.contains('\u{1b}'), "escape codes in {logs:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_answered_by_its_first_attempt_logs_one_line() {
    let logs = logs_of_one_request("text").await;
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains("key=logged-key")).collect();
    // The attempt's line says how the execution ended; a `settled` line would repeat it.
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains(" attempt ") && lines[0].contains("outcome=\"success\""), "{lines:#?}");
}
