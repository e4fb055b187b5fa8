//! Logs: JSON on request, one span per logical request with its executions and attempts
//! beneath it, and never a body, a credential or a cookie; plain text without terminal colours
//! when they go to a file or a pipe; one line for a request its first attempt answered.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::Upstream;

/// What a broker logs in `format` while it answers one keyed request, read from a pipe.
async fn logs_of_one_request(format: &str) -> String {
    logs_while(format, "", async |http, base| {
        let r = http
            .post(format!("{base}/payments"))
            .header("idempotency-key", "logged-key")
            .header("authorization", "Bearer TOP-SECRET-TOKEN")
            .header("cookie", "session=COOKIE-SECRET")
            .body(r#"{"card":"SECRET-BODY-4242"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    })
    .await
}

/// What a broker (its `[server]` table given `server` lines) logs in `format` while `drive`
/// sends it requests, read from a pipe.
async fn logs_while(format: &str, server: &str, drive: impl AsyncFnOnce(&reqwest::Client, &str)) -> String {
    logs_under(None, format, server, drive).await
}

/// As [`logs_while`], with `RUST_LOG` set to `filter`.
async fn logs_under(
    filter: Option<&str>,
    format: &str,
    server: &str,
    drive: impl AsyncFnOnce(&reqwest::Client, &str),
) -> String {
    let upstream = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let port = |_| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (listen, admin) = (port(0), port(1));
    let config = dir.path().join("idem.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n{server}\n\
             [store]\nurl = \"sqlite://{}\"\n\
             [[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nupstream = \"{}\"\n",
            dir.path().join("idem.db").display(),
            upstream.url()
        ),
    )
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    match filter {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    let mut child = command
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
    drive(&http, &format!("http://127.0.0.1:{listen}")).await;
    // SIGTERM: a graceful exit writes out every line logged before it.
    let asked = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(asked.success());
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

/// The access lines of `logs` (JSON), in order.
fn access_lines(logs: &str) -> Vec<serde_json::Value> {
    logs.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .filter(|e| e["target"] == "idem::access")
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_answered_request_leaves_one_access_line_that_says_how_it_was_answered() {
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let logs = logs_while("json", "", async |http, base| {
        let keyed = |key: &str, body: &'static str| {
            http.post(format!("{base}/payments")).header("idempotency-key", key.to_string()).body(body)
        };
        let traced = keyed("access-key", r#"{"n":1}"#).header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"));
        assert_eq!(traced.send().await.unwrap().status(), 201);
        assert_eq!(keyed("access-key", r#"{"n":1}"#).send().await.unwrap().status(), 201, "a replay");
        assert_eq!(keyed("access-key", r#"{"n":2}"#).send().await.unwrap().status(), 422, "another body");
        assert_eq!(http.get(format!("{base}/payments/7")).send().await.unwrap().status(), 201, "no key");
        assert_eq!(http.get(format!("{base}/nowhere")).send().await.unwrap().status(), 404, "no route");
        assert_eq!(http.get(format!("{base}/_idem/requests/access-key")).send().await.unwrap().status(), 200);
        let later = keyed("later-key", "{}").header("prefer", "respond-async").send().await.unwrap();
        assert_eq!(later.status(), 202, "answered at once");
        let upstream_accepted = http.post(format!("{base}/payments?status=202")).header("idempotency-key", "its-202");
        assert_eq!(upstream_accepted.body("{}").send().await.unwrap().status(), 202, "the upstream's own 202");
        let too_big = http.put(format!("{base}/payments/7")).body(vec![b'x'; 1024 * 1024 + 1]);
        assert_eq!(too_big.send().await.unwrap().status(), 413, "no key, refused before it passes");
        let head = http.head(format!("{base}/payments/7"));
        assert_eq!(head.send().await.unwrap().status(), 201, "passed");
    })
    .await;
    let lines = access_lines(&logs);
    let said: Vec<(&str, &str, u64, &str, u64)> = lines
        .iter()
        .map(|l| {
            let f = &l["fields"];
            let text = |name: &str| f[name].as_str().unwrap_or_else(|| panic!("no {name} in {l}"));
            (
                text("http.request.method"),
                text("idem.route"),
                f["http.response.status_code"].as_u64().unwrap(),
                text("idem.answer"),
                f["idem.attempts"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        said,
        [
            ("POST", "payments", 201, "executed", 1),
            ("POST", "payments", 201, "replay", 0),
            ("POST", "payments", 422, "problem", 0),
            ("GET", "payments", 201, "passed", 0),
            ("GET", "-", 404, "problem", 0),
            ("GET", "-", 200, "own", 0),
            ("POST", "payments", 202, "accepted", 0),
            ("POST", "payments", 202, "executed", 1),
            ("PUT", "payments", 413, "problem", 0),
            ("HEAD", "payments", 201, "passed", 0),
        ]
    );
    assert_eq!(lines[9]["fields"]["http.response.body.size"], 0, "a HEAD's answer carries no body: {lines:#?}");
    // The key's hash, the same on every line of one key, and never the key.
    let key_hash = lines[0]["fields"]["idem.key"].as_str().unwrap();
    assert_eq!(key_hash.len(), 16, "{key_hash}");
    assert!(lines[..3].iter().all(|l| l["fields"]["idem.key"] == key_hash), "{lines:#?}");
    assert_eq!(lines[3]["fields"]["idem.key"], "-");
    // Where it came from and what it was, as OpenTelemetry names them.
    let first = &lines[0]["fields"];
    assert_eq!((&first["client.address"], &first["url.path"]), (&"127.0.0.1".into(), &"/payments".into()), "{first}");
    assert_eq!((&first["http.request.body.size"], &first["idem.tenant"]), (&7.into(), &"default".into()), "{first}");
    assert!(first["http.response.body.size"].as_u64().is_some(), "{first}");
    // The record that answered: the one the first request made, which its replay and the
    // client's own endpoint read.
    let record = first["idem.record"].as_str().unwrap();
    assert_eq!(record.len(), 36, "{record}");
    assert_eq!(
        (&lines[1]["fields"]["idem.record"], &lines[1]["fields"]["idem.replay"]),
        (&record.into(), &true.into())
    );
    assert_eq!(lines[3]["fields"]["idem.record"], "-", "a pass-through records nothing");
    assert!(!lines.iter().any(|l| l.to_string().contains("access-key")), "the key itself was logged");
    assert_eq!(lines[0]["fields"]["trace_id"], trace, "the client's trace");
    assert_eq!(lines[1]["fields"]["trace_id"], "-");
    assert!(lines.iter().all(|l| l["fields"]["duration_ms"].as_f64().is_some()), "{lines:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn access_log_false_turns_the_access_lines_off() {
    let logs = logs_while("json", "access_log = false", async |http, base| {
        let r = http.post(format!("{base}/payments")).header("idempotency-key", "quiet").body("{}").send().await;
        assert_eq!(r.unwrap().status(), 201);
    })
    .await;
    assert!(access_lines(&logs).is_empty(), "{logs}");
    assert!(logs.contains("\"attempt\""), "the other lines are still written: {logs}");
}

#[tokio::test(flavor = "multi_thread")]
async fn rust_log_drops_the_access_lines_apart_from_the_rest_in_either_format() {
    for format in ["json", "text"] {
        let logs = logs_under(Some("info,idem::access=off"), format, "", async |http, base| {
            let r = http.post(format!("{base}/payments")).header("idempotency-key", "unlogged").body("{}").send().await;
            assert_eq!(r.unwrap().status(), 201);
        })
        .await;
        assert!(!logs.contains("idem::access"), "{format}: {logs}");
        assert!(logs.contains("attempt"), "{format}: the other lines are still written: {logs}");
    }
    // A filter on a field the line does not have leaves it be, as tracing judges its events.
    let logs = logs_under(Some("info,idem::access[{user}]=off"), "json", "", async |http, base| {
        assert_eq!(http.get(format!("{base}/payments/1")).send().await.unwrap().status(), 201);
    })
    .await;
    assert_eq!(access_lines(&logs).len(), 1, "{logs}");
    // And the filter keeps it on its own.
    let logs = logs_under(Some("warn,idem::access=info"), "text", "", async |http, base| {
        assert_eq!(http.get(format!("{base}/payments/1")).send().await.unwrap().status(), 201);
    })
    .await;
    let lines: Vec<&str> = logs.lines().collect();
    assert!(lines.len() == 1 && lines[0].contains("INFO idem::access: answered "), "{logs}");
}
