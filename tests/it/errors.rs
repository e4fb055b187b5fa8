//! What `idem serve` says when it cannot start: one line, each cause said once, naming the
//! thing at fault (the address and its setting, the host and port, the file) and what to do.
//! The causes come from real faults: a port taken, nothing listening where the store should
//! be, a server certificate from an authority nobody named, a mode misspelt, a directory that
//! does not exist.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::backend;
use crate::common::TestConfig;

/// `idem serve` on `config_text`: whether it failed, how long it took, and what it said last.
fn serve(config_text: &str) -> (bool, Duration, String) {
    let dir = tempfile::TempDir::new().unwrap();
    let config = dir.path().join("idem.toml");
    std::fs::write(&config, config_text).unwrap();
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default().to_string();
    (!out.status.success(), start.elapsed(), last)
}

/// Each clause of `line` (between `: ` and `; `) is said once, and none repeats within another.
fn said_once(line: &str) {
    let clauses: Vec<&str> = line.split([':', ';']).map(str::trim).filter(|c| c.len() > 12).collect();
    for (i, a) in clauses.iter().enumerate() {
        for b in &clauses[i + 1..] {
            assert!(!b.contains(a) && !a.contains(b), "`{a}` said twice in: {line}");
        }
    }
}

#[test]
fn a_taken_port_is_named_with_its_setting_and_the_cause_said_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::TempDir::new().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idem.db").display());
    let text = TestConfig::new("http://127.0.0.1:9").store(&store).text().replacen(
        "\nlisten = \"127.0.0.1:0\"",
        &format!("\nlisten = \"{addr}\""),
        1,
    );
    let (failed, _, said) = serve(&text);
    assert!(failed, "{said}");
    assert!(said.contains(&format!("cannot listen on {addr} (`server.listen`")), "{said}");
    assert_eq!(said.matches("Address already in use").count(), 1, "{said}");
    assert!(said.contains("another process listens there"), "{said}");
    said_once(&said);
}

#[test]
fn a_sqlite_directory_that_does_not_exist_is_named() {
    let dir = tempfile::TempDir::new().unwrap();
    let missing = dir.path().join("no-such-dir");
    let store = format!("sqlite://{}/idem.db", missing.display());
    let (failed, _, said) = serve(&TestConfig::new("http://127.0.0.1:9").store(&store).text());
    assert!(failed, "{said}");
    assert!(said.contains(&format!("the directory {} of the SQLite file", missing.display())), "{said}");
    said_once(&said);
}

#[test]
fn a_store_nothing_listens_for_fails_at_once_naming_its_host_and_port() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let store = format!("postgres://idem@{closed}/idem");
    let (failed, took, said) = serve(&TestConfig::new("http://127.0.0.1:9").store(&store).text());
    assert!(failed, "{said}");
    assert!(took < Duration::from_secs(10), "failed fast, not after the pool's 30 s: {took:?}");
    assert!(said.contains(&format!("cannot connect to the store at {closed}")), "{said}");
    assert_eq!(said.matches("Connection refused").count(), 1, "{said}");
    assert!(said.contains("is the server running"), "{said}");
    said_once(&said);
}

#[test]
fn a_misspelt_sslmode_is_refused_with_the_modes_listed() {
    let text =
        TestConfig::new("http://127.0.0.1:9").store("postgres://idem@db.internal/idem?sslmode=verify_full").text();
    let (failed, _, said) = serve(&text);
    assert!(failed, "{said}");
    assert!(said.contains("store.url") && said.contains("sslmode=verify_full is not a mode"), "{said}");
    assert!(said.contains("verify-ca, verify-full"), "{said}");
    said_once(&said);
}

/// The test server's certificate comes from a private authority: without `sslrootcert`, the
/// refusal says to name it; with another authority's file, it names that file.
#[test]
fn a_certificate_from_an_authority_not_named_says_to_name_it() {
    let Some(server) = backend::postgres_server_url() else {
        return backend::skipped("errors::a_certificate_from_an_authority_not_named_says_to_name_it");
    };
    let port = reqwest::Url::parse(&server).unwrap().port().unwrap_or(5432);
    let store = format!("postgres://postgres@localhost:{port}/postgres?sslmode=verify-full");
    let (failed, _, said) = serve(&TestConfig::new("http://127.0.0.1:9").store(&store).text());
    assert!(failed, "{said}");
    assert!(said.contains(&format!("cannot connect to the store at localhost:{port}")), "{said}");
    assert_eq!(said.matches("UnknownIssuer").count(), 1, "{said}");
    assert!(said.contains("name its authority with sslrootcert="), "{said}");
    said_once(&said);

    let other = crate::common::pki::Authority::new("another authority");
    let dir = tempfile::TempDir::new().unwrap();
    let file = other.write(dir.path(), "other-ca");
    let store = format!("{store}&sslrootcert={}", file.display());
    let (failed, _, said) = serve(&TestConfig::new("http://127.0.0.1:9").store(&store).text());
    assert!(failed, "{said}");
    assert!(said.contains(&format!("not issued by the authority in {}", file.display())), "{said}");
    said_once(&said);
}
