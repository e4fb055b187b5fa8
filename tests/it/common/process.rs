//! Real broker processes: the built `idem` binary run as `idem serve --config <file>`, so a test
//! can crash a broker the way production does (SIGKILL, SIGTERM) and start it again on the same
//! ports and the same database. Each node logs to a file of its own; when a test fails while a
//! node is alive, the tail of that log is printed. Kill loops drive such nodes with clients that
//! retry until their request is settled, then audit what every key left behind.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tempfile::TempDir;
use tokio::task::JoinHandle;

use super::Upstream;

/// The lease every node runs with: short, so a dead node's records are taken over within a
/// second or two.
pub const LEASE: Duration = Duration::from_secs(1);

/// How long a node may take to answer `/readyz` after it was started.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Ports on 127.0.0.1 that were free a moment ago, all different: bound on port 0 together, then
/// released (a port released at once may well be the next one handed out, so none is released
/// before all are picked). A node binds them again at once, and again after every restart.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: [std::net::TcpListener; N] = std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    held.map(|l| l.local_addr().unwrap().port())
}

/// A node's config on the store at `db_url`: `config`, its worker on the short [`LEASE`].
pub fn node_config(db_url: &str, config: super::TestConfig) -> super::TestConfig {
    config.store(db_url).worker(&format!("lease = \"{}ms\"", LEASE.as_millis()))
}

/// One `idem serve` process, on two fixed ports that survive its restarts.
pub struct Node {
    /// Names the node in failure messages and in its log.
    pub name: String,
    pub url: String,
    pub admin: String,
    pub http: reqwest::Client,
    config: PathBuf,
    /// The `[server]` section written at start: its ports stay the node's for good.
    server: String,
    /// Set in the process's environment at every start (a clock offset, say).
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    /// How many times the process was started.
    pub starts: u32,
    _dir: TempDir,
}

impl Node {
    /// Writes the config (`body` with a `[server]` section on fresh ports), starts the process,
    /// and returns once it is ready.
    pub async fn start(name: &str, body: &str) -> Node {
        Node::start_with_env(name, body, Vec::new()).await
    }

    /// [`Node::start`], with `env` in the process's environment at every start.
    pub async fn start_with_env(name: &str, body: &str, env: Vec<(String, String)>) -> Node {
        let dir = TempDir::new().unwrap();
        let [listen, admin] = free_ports();
        let config = dir.path().join("idem.toml");
        let server = format!("[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n");
        std::fs::write(&config, format!("{server}{body}")).unwrap();
        let mut node = Node {
            name: name.to_string(),
            url: format!("http://127.0.0.1:{listen}"),
            admin: format!("http://127.0.0.1:{admin}"),
            http: reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build().unwrap(),
            log: dir.path().join("idem.log"),
            config,
            server,
            env,
            child: None,
            starts: 0,
            _dir: dir,
        };
        node.spawn().await;
        node
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        self.starts += 1;
        let mut log = OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        writeln!(log, "==== {} start #{} ====", self.name, self.starts).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("serve")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.name));
        self.child = Some(child);
        self.await_ready().await;
    }

    async fn await_ready(&mut self) {
        let until = Instant::now() + READY_WITHIN;
        let probe = reqwest::Client::builder().no_proxy().timeout(Duration::from_millis(500)).build().unwrap();
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                self.child = None;
                panic!("{} exited before it was ready ({status}):\n{}", self.name, self.log_tail(40));
            }
            if let Ok(r) = probe.get(format!("{}/readyz", self.admin)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if Instant::now() > until {
                panic!("{} was not ready within {READY_WITHIN:?}:\n{}", self.name, self.log_tail(40));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL: the process dies at once, in the middle of whatever it was doing.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Rewrites the node's config file with `body` under the same `[server]` section; the
    /// running process reads it on a reload (see [`Node::hangup`]) or at its next start.
    pub fn write_config(&self, body: &str) {
        std::fs::write(&self.config, format!("{}{body}", self.server)).unwrap();
    }

    /// SIGSTOP: the process freezes where it stands, its connections open (a stop-the-world
    /// stall, a frozen VM); see [`Node::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT: the paused process goes on from where it stood.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().unwrap_or_else(|| panic!("{} is not running", self.name));
        let sent = Command::new("kill").arg(signal).arg(pid.to_string()).status().unwrap();
        assert!(sent.success(), "could not send {signal} to {}", self.name);
    }

    /// SIGHUP: asks the process to read its config file again.
    pub fn hangup(&self) {
        let pid = self.pid().unwrap_or_else(|| panic!("{} is not running", self.name));
        let sent = Command::new("kill").arg("-HUP").arg(pid.to_string()).status().unwrap();
        assert!(sent.success(), "could not send SIGHUP to {}", self.name);
    }

    /// SIGTERM: asks for a graceful shutdown; see [`Node::wait_exit`].
    /// The configuration file the node was started from.
    pub fn config_file(&self) -> &std::path::Path {
        &self.config
    }

    pub fn terminate(&mut self) {
        let pid = self.pid().unwrap_or_else(|| panic!("{} is not running", self.name));
        let sent = Command::new("kill").arg("-TERM").arg(pid.to_string()).status().unwrap();
        assert!(sent.success(), "could not send SIGTERM to {}", self.name);
    }

    /// Waits up to `within` for the process to exit by itself; `None` if it is still running.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let until = Instant::now() + within;
        loop {
            let status = self.child.as_mut()?.try_wait().unwrap();
            if let Some(status) = status {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the process again, on the same ports, config and database.
    pub async fn restart(&mut self) {
        self.spawn().await;
    }

    /// The last `lines` lines the process (all its runs) wrote.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Waits until a line of the log satisfies `pred`; fails after 10 s with the log's tail.
    #[allow(dead_code)]
    pub async fn await_log_line(&self, pred: impl Fn(&str) -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !self.log_tail(usize::MAX).lines().any(&pred) {
            assert!(Instant::now() < until, "no such line in the log:\n{}", self.log_tail(80));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn post(&self, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        super::keyed_post(&self.http, &self.url, path, key, body)
    }

    /// `/metrics` as the node's admin listener renders it, whatever its store's state.
    pub async fn metrics(&self) -> String {
        let r = self.http.get(format!("{}/metrics", self.admin)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}: /metrics must answer whatever the store's state", self.name);
        r.text().await.unwrap()
    }

    /// The record of `key` as `GET /_idem/requests/{key}` shows it (history included), or
    /// `None` when there is none.
    pub async fn record(&self, key: &str) -> Option<Value> {
        let r = self.http.get(format!("{}/_idem/requests/{key}", self.url)).send().await.unwrap();
        match r.status().as_u16() {
            200 => Some(r.json().await.unwrap()),
            404 => None,
            other => panic!("{}: reading the record of {key} answered {other}: {}", self.name, r.text().await.unwrap()),
        }
    }

    /// Polls the record of `key` until `pred` holds; fails after `within`.
    pub async fn await_record(&self, key: &str, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let until = Instant::now() + within;
        loop {
            let record = self.record(key).await;
            if let Some(v) = &record {
                if pred(v) {
                    return v.clone();
                }
            }
            if Instant::now() > until {
                panic!("{}: the record of {key} never reached the expected state: {record:#?}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = writeln!(std::io::stderr(), "---- last lines of {} ----\n{}", self.name, self.log_tail(60));
        }
        self.kill();
    }
}

/// Polls `done` every 10 ms until it holds; fails with `what` after `within`.
pub async fn await_until(what: &str, within: Duration, done: impl Fn() -> bool) {
    let until = Instant::now() + within;
    while !done() {
        if Instant::now() > until {
            panic!("waited {within:?} in vain for {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The entries of a record's `history` whose action starts with `prefix`.
pub fn history_entries<'a>(record: &'a Value, prefix: &str) -> Vec<&'a Value> {
    record["history"]
        .as_array()
        .map(|h| h.iter().filter(|e| e["action"].as_str().is_some_and(|a| a.starts_with(prefix))).collect())
        .unwrap_or_default()
}

// ---- kill loops: clients that retry until settled, and the audit afterwards -------------------

/// A kill loop's plan: `keys` keys (named `{prefix}-NNN`) released `spacing` apart, each taking
/// the fake upstream up to `upstream_delay_ms`; `kills` SIGKILLs 1.2–2.4 s apart, each of a node
/// picked at random, restarted after up to `down_ms`.
pub struct KillLoop {
    pub name: String,
    pub prefix: &'static str,
    pub keys: usize,
    pub kills: usize,
    pub spacing: Duration,
    pub upstream_delay_ms: u64,
    pub down_ms: u64,
}

/// Runs `plan` against `nodes`: every key's client starts on a node of its own (key i on node
/// i mod n) and moves on to the next after a failed try, until its answer settles it. Once the
/// leases of what the dead left have passed, every key is audited through the first node; the
/// summary is printed with the seed, and the audit must be clean.
pub async fn kill_loop(plan: KillLoop, nodes: &mut [Node], upstream: &Upstream) {
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let keys: Vec<LoopKey> = (0..plan.keys)
        .map(|i| LoopKey {
            key: format!("{}-{i:03}", plan.prefix),
            path: format!("/payments?delay_ms={}", rng.gen_range(0..plan.upstream_delay_ms)),
            body: serde_json::json!({"order": i, "memo": "m".repeat(200)}).to_string(),
            release: started + plan.spacing * i as u32,
            nodes: (0..urls.len()).map(|n| urls[(i + n) % urls.len()].clone()).collect(),
            insists: false,
        })
        .collect();
    let clients = start_clients(keys, started + Duration::from_secs(40));

    let mut killed = Vec::new();
    for _ in 0..plan.kills {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1200..2400))).await;
        let victim = rng.gen_range(0..nodes.len());
        nodes[victim].kill();
        killed.push(victim);
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..plan.down_ms))).await;
        nodes[victim].restart().await;
    }

    let ended = join_clients(clients).await;
    // Whatever a dead process left is taken over within a lease; let that settle.
    tokio::time::sleep(2 * LEASE + Duration::from_millis(500)).await;
    let audit = audit(&nodes[0], upstream, &ended).await;
    // Straight to stderr, past the harness's capture: the summary is wanted when the test passes.
    let _ = writeln!(
        std::io::stderr(),
        "{} (seed {seed}): {} keys: {}; killed nodes {killed:?}, {:.1} s",
        plan.name,
        plan.keys,
        audit.summary(),
        started.elapsed().as_secs_f64()
    );
    audit.assert_clean(plan.keys);
}

/// One key of a kill loop: its request, when its client starts, and the nodes it may use.
pub struct LoopKey {
    pub key: String,
    /// Path and query; a per-key `?delay_ms=` lets the fake upstream take its time.
    pub path: String,
    pub body: String,
    pub release: Instant,
    /// Data-plane URLs; the client moves to the next one after each failed try.
    pub nodes: Vec<String>,
    /// An agent that retries through `outcome-unknown` too, until it hears the outcome: the
    /// client of a record freed too early would execute it again.
    pub insists: bool,
}

/// How a client's retries for one key ended.
#[derive(Debug)]
pub enum Ended {
    /// A 201 arrived, with these body bytes.
    Acknowledged(Bytes),
    /// 502 `outcome-unknown`.
    Unknown,
    /// The test's time ran out while the client was still retrying; the last thing it saw.
    GaveUp(String),
    /// An answer the broker must never give here.
    Unexpected(u16, Bytes),
}

/// Sends one keyed request until it gets an answer that settles it, retrying with the same key
/// after a short pause on connection errors, 409 (in progress), 503 and 504 (freed: send again).
pub async fn send_until_settled(http: reqwest::Client, k: LoopKey, give_up: Instant) -> Ended {
    let mut rng = StdRng::from_entropy();
    let mut last = String::from("nothing sent");
    let mut tries = 0;
    while Instant::now() < give_up {
        let url = format!("{}{}", k.nodes[tries % k.nodes.len()], k.path);
        tries += 1;
        let sent = http
            .post(&url)
            .header("idempotency-key", &k.key)
            .header("content-type", "application/json")
            .body(k.body.clone())
            .send()
            .await;
        match sent {
            Err(e) => last = format!("error: {e}"),
            Ok(r) => {
                let status = r.status().as_u16();
                match r.bytes().await {
                    // The broker died while it was writing the answer: nothing was received.
                    Err(e) => last = format!("{status} cut short: {e}"),
                    Ok(bytes) => match status {
                        201 => return Ended::Acknowledged(bytes),
                        502 if String::from_utf8_lossy(&bytes).contains("outcome-unknown") && !k.insists => {
                            return Ended::Unknown
                        }
                        502 if String::from_utf8_lossy(&bytes).contains("outcome-unknown") => {
                            last = "502 outcome-unknown".into();
                            tokio::time::sleep(Duration::from_millis(400)).await;
                        }
                        409 | 503 | 504 => last = format!("{status}: {}", String::from_utf8_lossy(&bytes)),
                        _ => return Ended::Unexpected(status, bytes),
                    },
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(50..150))).await;
    }
    Ended::GaveUp(last)
}

/// One client task per key, each starting at its key's release time.
pub fn start_clients(keys: Vec<LoopKey>, give_up: Instant) -> Vec<JoinHandle<(String, Ended)>> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(20)).build().unwrap();
    keys.into_iter()
        .map(|k| {
            let http = http.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(tokio::time::Instant::from_std(k.release)).await;
                let key = k.key.clone();
                (key, send_until_settled(http, k, give_up).await)
            })
        })
        .collect()
}

pub async fn join_clients(clients: Vec<JoinHandle<(String, Ended)>>) -> BTreeMap<String, Ended> {
    let mut ended = BTreeMap::new();
    for c in clients {
        let (key, e) = c.await.unwrap();
        ended.insert(key, e);
    }
    ended
}

/// What a kill loop left behind, key by key.
#[derive(Default)]
pub struct Audit {
    pub done: usize,
    pub unknown: usize,
    pub free: usize,
    pub absent: usize,
    pub problems: Vec<String>,
}

impl Audit {
    pub fn summary(&self) -> String {
        format!("{} done, {} unknown, {} free, {} never recorded", self.done, self.unknown, self.free, self.absent)
    }

    pub fn assert_clean(&self, keys: usize) {
        assert!(self.problems.is_empty(), "{} problems:\n{}", self.problems.len(), self.problems.join("\n"));
        assert!(self.done > keys / 2, "too little got through to mean anything: {}", self.summary());
    }
}

/// Checks every key of a kill loop, reading records through `node`: no key executed twice;
/// every record `done` (with one execution and its 201), `unknown`, or free (with none); and
/// every 201 a client received is the response its `done` record keeps, byte for byte.
pub async fn audit(node: &Node, upstream: &Upstream, ended: &BTreeMap<String, Ended>) -> Audit {
    let mut a = Audit::default();
    for (key, end) in ended {
        let hits = upstream.hits(key);
        if hits > 1 {
            a.problems.push(format!("{key}: executed {hits} times"));
        }
        let record = node.record(key).await;
        let state = record.as_ref().map(|r| r["state"].as_str().unwrap().to_string());
        let queued = record.as_ref().and_then(|r| r["queued"].as_bool());
        match (state.as_deref(), queued) {
            (Some("done"), _) => {
                a.done += 1;
                let response = &record.as_ref().unwrap()["response"];
                if response["status"] != 201 || hits != 1 {
                    a.problems.push(format!("{key}: done with {response} after {hits} executions"));
                }
            }
            (Some("unknown"), _) => a.unknown += 1,
            (Some("not_started"), Some(false)) => {
                a.free += 1;
                if hits != 0 {
                    a.problems.push(format!("{key}: free, yet the upstream executed it {hits} times"));
                }
            }
            (None, _) => {
                a.absent += 1;
                if hits != 0 {
                    a.problems.push(format!("{key}: no record, yet the upstream executed it {hits} times"));
                }
            }
            _ => a.problems.push(format!("{key}: left {state:?} (queued: {queued:?}) after the settle")),
        }
        match end {
            Ended::Acknowledged(bytes) => {
                let stored = record.as_ref().filter(|r| r["state"] == "done").map(|r| r["response"]["body"].clone());
                if stored != Some(Value::String(String::from_utf8_lossy(bytes).into_owned())) {
                    a.problems.push(format!(
                        "{key}: the client got 201 {:?}, the record holds {stored:?}",
                        String::from_utf8_lossy(bytes)
                    ));
                }
            }
            Ended::Unknown => {
                if state.as_deref() != Some("unknown") {
                    a.problems.push(format!("{key}: the client was told unknown, the record is {state:?}"));
                }
            }
            Ended::GaveUp(last) => {
                a.problems.push(format!("{key}: the client never got a settled answer; last {last}"))
            }
            Ended::Unexpected(status, body) => {
                a.problems.push(format!("{key}: unexpected answer {status} {:?}", String::from_utf8_lossy(body)))
            }
        }
    }
    a
}
