//! `idem demo` as a person runs it: the scripted scenario's table, then the URLs and curl lines,
//! then it serves.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_demo_tells_the_story_then_serves() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["demo", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let until = Instant::now() + Duration::from_secs(40);
    while !lines.iter().any(|l: &String| l.starts_with("Serving until Ctrl-C")) {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("the demo did not finish its scenario: {lines:#?}");
            }
        }
    }
    let row = |start: &str| lines.iter().find(|l| l.trim_start().starts_with(start)).cloned().unwrap_or_default();
    let words = |l: String| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();

    let new = words(row("POST /payments, new key"));
    assert!(new.contains(&"201".into()) && new.last() == Some(&"done".into()), "{new:?}");
    let replay = row("the same again");
    assert!(replay.contains("201 replayed") && replay.trim_end().ends_with("done"), "{replay}");
    assert!(row("same key, another body").contains("422 idempotency-key-reused"));
    let retried = words(row("503 + Retry-After"));
    assert!(retried.contains(&"201".into()), "{retried:?}");
    assert_eq!(retried[retried.len() - 3], "2", "two attempts: {retried:?}");
    let waited: u64 = retried[retried.len() - 2].trim_end_matches("ms").parse().unwrap();
    assert!(waited >= 1000, "the retry waited for Retry-After: {waited} ms");
    let hung = row("hangs past the per-try timeout");
    assert!(hung.contains("502 outcome-unknown") && hung.trim_end().ends_with("unknown"), "{hung}");
    let settled = row("…then the probe asks the upstream");
    assert!(settled.contains("→ 200") && settled.trim_end().ends_with("done"), "{settled}");

    // Then it serves: the printed broker URL answers.
    let broker = lines.iter().find_map(|l| l.trim().strip_prefix("broker")).unwrap().split_whitespace().next().unwrap();
    let health = broker.replace("http://", "");
    assert!(std::net::TcpStream::connect(health).is_ok());
    assert!(lines.iter().any(|l| l.contains("curl -i -X POST")));
    child.kill().unwrap();
    child.wait().unwrap();
}
