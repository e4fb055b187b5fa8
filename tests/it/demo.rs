//! `idem demo` as a person runs it: quiet logs, the scripted scenario's table first, then the
//! URLs (the console's with what to look at) and curl lines, then it serves.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

fn demo(verbose: bool) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command.args(["demo", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
    if verbose {
        command.arg("--verbose");
    }
    command.env_remove("RUST_LOG").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// The lines of `stream`, as they come.
fn lines(stream: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The body of `GET url` (plain HTTP/1.0, so that the test needs no client).
fn get(url: &str) -> String {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut stream = std::net::TcpStream::connect(host).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn the_demo_tells_the_story_then_serves() {
    let mut child = demo(false);
    let rx = lines(child.stdout.take().unwrap());
    let log = lines(child.stderr.take().unwrap());
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
    // The story comes first: nothing but its title before the table.
    let first: Vec<&String> = lines.iter().filter(|l| !l.trim().is_empty()).take(2).collect();
    assert!(first[0].starts_with("Idem demo:") && first[1].trim_start().starts_with("request"), "{lines:#?}");
    let hung = row("hangs past the per-try timeout");
    assert!(hung.contains("502 outcome-unknown") && hung.trim_end().ends_with("unknown"), "{hung}");
    let settled = row("…then the probe asks the upstream");
    assert!(settled.contains("→ 200") && settled.trim_end().ends_with("done"), "{settled}");

    // Then it serves: the printed broker URL answers.
    let broker = lines.iter().find_map(|l| l.trim().strip_prefix("broker")).unwrap().split_whitespace().next().unwrap();
    let health = broker.replace("http://", "");
    assert!(std::net::TcpStream::connect(health).is_ok());
    assert!(lines.iter().any(|l| l.contains("curl -i -X POST")));

    // The console's URL, with what to look at there: its Health view.
    let console = row("console");
    assert!(console.contains("Health") && console.contains("amplification"), "{console}");
    let console = console.split_whitespace().nth(1).unwrap();
    let page = get(console);
    assert!(page.starts_with("HTTP/1.0 200") && page.contains("id=\"health-view\""), "{page:.200}");

    child.kill().unwrap();
    child.wait().unwrap();
    // Quiet by default: no line of the log said anything below a warning.
    let logged: Vec<String> = log.try_iter().collect();
    assert!(!logged.iter().any(|l| l.contains("INFO")), "{logged:#?}");
}

#[test]
fn the_demo_logs_every_request_when_asked_to() {
    let mut child = demo(true);
    let log = lines(child.stderr.take().unwrap());
    let _stdout = lines(child.stdout.take().unwrap());
    let until = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains("INFO") && l.contains("settled")) {
        match log.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(line) => seen.push(line),
            Err(_) => {
                let _ = child.kill();
                panic!("no request was logged at info: {seen:#?}");
            }
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
}
