//! Real broker processes: the built `idem` binary run as `idem serve --config <file>`, so a test
//! can crash a broker the way production does (SIGKILL, SIGTERM) and start it again on the same
//! ports and the same database. Each node logs to a file of its own; when a test fails while a
//! node is alive, the tail of that log is printed.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

/// The lease every node runs with: short, so a dead node's records are taken over within a
/// second or two.
pub const LEASE: Duration = Duration::from_secs(1);

/// How long a node may take to answer `/readyz` after it was started.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A port on 127.0.0.1 that was free a moment ago: bound on port 0, then released. The node
/// binds it again at once, and again after every restart.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Everything of a node's config but `[server]`: the store, the worker with the short [`LEASE`]
/// (plus `worker_extra` lines), and one route, `payments` at `/payments`, in front of `upstream`,
/// with `route_extra` in its table and `extra` after it — the shape of `common::config_text`.
pub fn config_body(db_url: &str, upstream: &str, worker_extra: &str, route_extra: &str, extra: &str) -> String {
    format!(
        r#"
[store]
url = "{db_url}"

[worker]
lease = "{lease}ms"
{worker_extra}

[[routes]]
name = "payments"
path_prefix = "/payments"
upstream = "{upstream}"
{route_extra}

{extra}
"#,
        lease = LEASE.as_millis()
    )
}

/// One `idem serve` process, on two fixed ports that survive its restarts.
pub struct Node {
    /// Names the node in failure messages and in its log.
    pub name: String,
    pub url: String,
    pub admin: String,
    pub http: reqwest::Client,
    config: PathBuf,
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
        let dir = TempDir::new().unwrap();
        let (listen, admin) = (free_port(), free_port());
        let config = dir.path().join("idem.toml");
        let text = format!("[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n{body}");
        std::fs::write(&config, text).unwrap();
        let mut node = Node {
            name: name.to_string(),
            url: format!("http://127.0.0.1:{listen}"),
            admin: format!("http://127.0.0.1:{admin}"),
            http: reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build().unwrap(),
            log: dir.path().join("idem.log"),
            config,
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

    /// SIGTERM: asks for a graceful shutdown; see [`Node::wait_exit`].
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

    pub fn post(&self, path: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{}", self.url, path))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_string())
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
