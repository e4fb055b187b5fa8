//! The fault soak: `idem serve` processes sharing one store (three on PostgreSQL, two on one
//! SQLite file) in front of an upstream that keeps a ledger of what it executed per key; clients
//! that retry the way real ones do; and, all along, a schedule of faults. Then every key is
//! audited against the ledger.
//!
//! ```text
//! cargo bench --bench soak -- [--store sqlite|postgres|failover]… [--secs N]
//! ```
//!
//! `--secs` (60 by default) is how long clients start new operations and faults keep coming;
//! the run then lets every client settle its key. Both stores by default, and the failover too
//! when `IDEM_SOAK_PG_PAIR` is set; PostgreSQL is the server `IDEM_TEST_POSTGRES_URL` names (a
//! database of its own is made for the run). With `IDEM_SOAK_PG_RESTART` set to a shell command
//! (`.ci/run` gives one), the PostgreSQL fault restarts the server with it; without, it ends
//! every connection of the run's database.
//!
//! `failover` runs a PostgreSQL primary and its synchronous standby on loopback with the command
//! `IDEM_SOAK_PG_PAIR` names (`.ci/pg-pair`), the nodes' store URL naming both hosts
//! (`target_session_attrs=read-write`). Among the other faults, the primary is stopped at once
//! (`pg_ctl -m immediate stop`) mid-traffic and the standby promoted; new keys are then sent
//! until one is answered, and the time from the promotion to that answer is printed; the old
//! primary is rebuilt as the new one's synchronous standby, ready for the next failover.
//!
//! The routes: `payments`, not replay-safe, with a probe that asks the upstream about a key
//! (`GET /payments/by-key/{key}`: what that key's execution answered, or 404), one second after
//! its record became `unknown`; and `refunds`, replay-safe, whose upstream deduplicates by key
//! and fences by the claim each attempt carries (`Idem-Attempt`): it refuses an attempt of an
//! older claim than one it has seen, as docs/guarantees.md shows an upstream can.
//!
//! The clients: each operation is a new key, one in five on `refunds`, the rest on `payments`,
//! its upstream call taking from a few milliseconds to 2.5 s; one in eight is first held in the
//! upstream's own queue for 1.2–3 s (past the probe's settle, within `per_try_timeout`) before it
//! executes. One `payments` operation in ten meets a gateway that answers 504 at once while the
//! service behind it executes the request 1–4 s later, and its client insists: it retries
//! through `outcome-unknown` until it hears the outcome, as an agent would, so a record freed
//! before its attempt's bound would be executed again. Every third probe's answer comes back
//! 1.5 s late. A client waits 1 s for an answer, then sends the same request again (to the next
//! node), and so on until it gets the outcome (201, or `outcome-unknown`); one operation in six
//! is sent by two clients at once. The faults, in turn, one every few seconds: a node killed
//! (SIGKILL) and started again; a node paused (SIGSTOP) for two and a half leases and resumed;
//! every worker of every node held by slow calls for longer than two leases; the store stalled
//! for two leases (an exclusive lock held on it); a node paused for longer than an attempt's
//! bound (its prober with it); and on PostgreSQL a restart of the server and one of its backends
//! killed (SIGKILL), which makes the server restart every backend. On PostgreSQL the nodes'
//! clocks disagree all along, by libfaketime (`FAKETIME_LIB`, Debian's package by default): one
//! runs two leases ahead, one a lease behind. (Every node on one SQLite file shares its host, and
//! so its clock: an offset between them cannot arise there.)
//!
//! It prints operations (keys: the clients' and the slow calls'), executions, duplicate executions (must be 0),
//! acknowledged answers lost (must be 0: a client got a 201 that the record does not keep byte
//! for byte), and what is left for reconciliation; it exits 1 if either must-be-0 is not.

#[path = "../tests/it/common/mod.rs"]
#[allow(dead_code)] // the soak uses part of the test harness
mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::backend;
use common::process::{node_config, send_until_settled, Ended, LoopKey, Node, LEASE};
use common::{TestConfig, Upstream};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;

/// Workers per node: few, so that slow calls can hold every one of them.
const CONCURRENCY: usize = 4;
/// How long a client waits for an answer before it sends the request again.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);
/// Clients running at once, each one operation at a time.
const CLIENTS: usize = 10;
/// How long clients keep retrying their last operations once the faults stopped.
const SETTLE: Duration = Duration::from_secs(60);
/// How long a long pause holds a node: past an attempt's bound (`per_try_timeout`, 10 s, plus the
/// send window and the clock margin), so that a probe it asked before is written after it.
const LONG_PAUSE: Duration = Duration::from_millis(12_500);
/// The library that offsets a node's clock (Debian's `faketime` package), unless
/// `FAKETIME_LIB` names another.
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The command that runs a PostgreSQL primary and its synchronous standby for the failover
/// soak (`.ci/pg-pair`: `start`, which prints their URL, `failover`, `rebuild`, `stop`).
const PAIR_VAR: &str = "IDEM_SOAK_PG_PAIR";

/// What a run soaks: one SQLite file; one PostgreSQL server; or a PostgreSQL primary with a
/// synchronous standby, failed over mid-traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Sqlite,
    Postgres,
    Failover,
}

impl Run {
    fn name(self) -> &'static str {
        match self {
            Run::Sqlite => "sqlite",
            Run::Postgres => "postgres",
            Run::Failover => "postgres failing over",
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut stores = Vec::new();
    let mut secs = 60;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--store" => match it.next().map(String::as_str) {
                Some("sqlite") => stores.push(Run::Sqlite),
                Some("postgres") => stores.push(Run::Postgres),
                Some("failover") => stores.push(Run::Failover),
                other => fail(&format!("--store takes sqlite, postgres or failover, not {other:?}")),
            },
            "--secs" => {
                secs = it.next().and_then(|s| s.parse().ok()).unwrap_or_else(|| fail("--secs takes a whole number"))
            }
            other => fail(&format!("unknown argument {other}; see the top of benches/soak.rs")),
        }
    }
    if stores.is_empty() {
        stores = vec![Run::Sqlite, Run::Postgres];
        if std::env::var_os(PAIR_VAR).is_some() {
            stores.push(Run::Failover);
        }
    }
    let mut clean = true;
    for store in stores {
        let report = soak(store, Duration::from_secs(secs)).await;
        println!("{report}");
        clean &= report.doubles == 0 && report.lost == 0;
    }
    if !clean {
        eprintln!("soak: a non-replay-safe request executed twice, or an acknowledged answer was lost");
        std::process::exit(1);
    }
}

fn fail(why: &str) -> ! {
    eprintln!("soak: {why}");
    std::process::exit(2)
}

/// What one run left behind.
#[derive(Default)]
struct Report {
    store: &'static str,
    nodes: usize,
    secs: u64,
    operations: usize,
    executions: u32,
    /// Executions beyond the first, summed over keys (all keys are on a non-replay-safe route).
    doubles: u32,
    /// 201s received whose record does not hold that answer byte for byte.
    lost: usize,
    done: usize,
    unknown: usize,
    free: usize,
    never_recorded: usize,
    /// Clients still without an outcome when the settle ran out.
    unsettled: usize,
    faults: BTreeMap<&'static str, u32>,
    /// Each node's clock offset, where one was set.
    clocks: Vec<String>,
    /// For each failover, the time from the standby's promotion to the next new key answered.
    failovers: Vec<Duration>,
    problems: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let faults: Vec<String> = self.faults.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        writeln!(f, "soak on {} ({} nodes, {} s of faults: {})", self.store, self.nodes, self.secs, faults.join(", "))?;
        if !self.clocks.is_empty() {
            writeln!(f, "clocks: {}", self.clocks.join(", "))?;
        }
        if !self.failovers.is_empty() {
            let each: Vec<String> = self.failovers.iter().map(|d| format!("{} ms", d.as_millis())).collect();
            writeln!(f, "from promotion to the next new key answered: {}", each.join(", "))?;
        }
        writeln!(f, "| operations | executions | duplicate executions | acknowledged lost | done | unknown | free | never recorded | unsettled |")?;
        writeln!(f, "|---|---|---|---|---|---|---|---|---|")?;
        writeln!(
            f,
            "| {} | {} | **{}** | **{}** | {} | {} | {} | {} | {} |",
            self.operations,
            self.executions,
            self.doubles,
            self.lost,
            self.done,
            self.unknown,
            self.free,
            self.never_recorded,
            self.unsettled
        )?;
        for p in self.problems.iter().take(20) {
            writeln!(f, "  {p}")?;
        }
        Ok(())
    }
}

/// The broker's store for the run: its URL, and (SQLite) the folder that holds the file.
struct Store {
    url: String,
    sqlite: Option<tempfile::TempDir>,
}

async fn store_for(run: Run) -> Store {
    match run {
        Run::Sqlite => {
            let dir = tempfile::TempDir::new().unwrap();
            Store { url: format!("sqlite://{}", dir.path().join("idem.db").display()), sqlite: Some(dir) }
        }
        Run::Postgres => match backend::postgres_url_for_new_db().await {
            Some(url) => Store { url, sqlite: None },
            None => fail("set IDEM_TEST_POSTGRES_URL to soak PostgreSQL"),
        },
        Run::Failover => {
            let said = pair("start").await;
            let url = said.lines().last().unwrap_or_default().to_string();
            Store { url, sqlite: None }
        }
    }
}

/// Runs `IDEM_SOAK_PG_PAIR` with `what`; what it printed.
async fn pair(what: &'static str) -> String {
    let Ok(command) = std::env::var(PAIR_VAR) else {
        fail(&format!("set {PAIR_VAR} (.ci/pg-pair) to soak a failover"))
    };
    let out = tokio::task::spawn_blocking(move || Command::new(&command).arg(what).output().unwrap()).await.unwrap();
    if !out.status.success() {
        fail(&format!("{PAIR_VAR} {what} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn soak(run: Run, secs: Duration) -> Report {
    let upstream = Upstream::start().await;
    upstream.answer_probes_late(3, Duration::from_millis(1_500));
    let store = store_for(run).await;
    let worker = format!("concurrency = {CONCURRENCY}\n");
    let route = "replay_safe = false\n[routes.retry]\ndeadline = \"30s\"\nper_try_timeout = \"10s\"\n\
                 [routes.probe]\nmethod = \"GET\"\npath = \"/payments/by-key/{idempotency_key}\"\nsettle = \"1s\"\n";
    let refunds = format!(
        "[[routes]]\nname = \"refunds\"\npath_prefix = \"/refunds\"\nupstream = \"{}\"\nreplay_safe = true\n\
         [routes.retry]\ndeadline = \"30s\"\nper_try_timeout = \"10s\"\nnot_processed = [409, 429, 503]\n",
        upstream.url()
    );
    let config = TestConfig::new(&upstream.url()).worker(&worker).route(route).tables(&refunds);
    let body = node_config(&store.url, config).body();
    let count = if run == Run::Sqlite { 2 } else { 3 };
    let mut nodes = Vec::new();
    for i in 0..count {
        nodes.push(Node::start_with_env(&format!("node{i}"), &body, clock_offset(run, i)).await);
    }
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let nodes = Arc::new(Mutex::new(nodes));

    let start = Instant::now();
    let stop_at = start + secs;
    let give_up = stop_at + SETTLE;
    let http = reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build().unwrap();

    let faults = tokio::spawn(faults(nodes.clone(), run, store.url.clone(), urls.clone(), stop_at));
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (http, urls) = (http.clone(), urls.clone());
        clients.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(c as u64);
            let mut ended = Vec::new();
            let mut n = 0;
            while Instant::now() < stop_at {
                n += 1;
                let key = format!("soak-{c}-{n}");
                let delay = match rng.gen_range(0..10) {
                    0..=6 => rng.gen_range(0..50),
                    7 | 8 => rng.gen_range(200..900),
                    _ => rng.gen_range(1_200..2_500),
                };
                let copies = if rng.gen_range(0..6) == 0 { 2 } else { 1 };
                let route = if rng.gen_range(0..5) == 0 { "/refunds?dedupe=1&" } else { "/payments?" };
                let gateway = route == "/payments?" && rng.gen_range(0..10) == 0;
                let queue = match rng.gen_range(0..8) {
                    _ if gateway => format!("gateway_ms={}&", rng.gen_range(1_000..4_000)),
                    0 => format!("queue_ms={}&", rng.gen_range(1_200..3_000)),
                    _ => String::new(),
                };
                let sends: Vec<_> = (0..copies)
                    .map(|copy| {
                        let mut nodes = urls.clone();
                        nodes.rotate_left((c + copy) % urls.len());
                        let k = LoopKey {
                            key: key.clone(),
                            path: format!("{route}{queue}delay_ms={delay}"),
                            body: format!(r#"{{"op":"{key}","amount":42}}"#),
                            release: Instant::now(),
                            nodes,
                            insists: gateway,
                        };
                        tokio::spawn(send_until_settled(http.clone(), k, give_up))
                    })
                    .collect();
                for send in sends {
                    ended.push((key.clone(), send.await.unwrap()));
                }
            }
            ended
        }));
    }
    let mut ended: BTreeMap<String, Vec<Ended>> = BTreeMap::new();
    for client in clients {
        for (key, end) in client.await.unwrap() {
            ended.entry(key).or_default().push(end);
        }
    }
    let Injected { counts, slow, failovers } = faults.await.unwrap();
    for key in slow {
        ended.entry(key).or_default();
    }

    let nodes = nodes.lock().await;
    let mut report = audit(&nodes[0], &upstream, &ended).await;
    report.store = run.name();
    report.nodes = count;
    report.secs = secs.as_secs();
    report.faults = counts;
    report.failovers = failovers;
    report.clocks = (0..count)
        .filter_map(|i| {
            let env = clock_offset(run, i);
            env.iter().find(|(k, _)| k == "FAKETIME").map(|(_, offset)| format!("node{i} {offset} s"))
        })
        .collect();
    drop(nodes);
    match run {
        Run::Postgres => backend::drop_postgres_db(&store.url).await,
        Run::Failover => drop(pair("stop").await),
        Run::Sqlite => {}
    }
    drop(store.sqlite);
    report
}

/// The environment that offsets node `i`'s clock: on PostgreSQL, node 0 runs two leases ahead
/// and node 1 a lease behind; none elsewhere.
fn clock_offset(run: Run, i: usize) -> Vec<(String, String)> {
    let offset = match (run, i) {
        (Run::Postgres | Run::Failover, 0) => format!("+{}ms", (2 * LEASE).as_millis()),
        (Run::Postgres | Run::Failover, 1) => format!("-{}ms", LEASE.as_millis()),
        _ => return Vec::new(),
    };
    let lib = std::env::var("FAKETIME_LIB").unwrap_or_else(|_| FAKETIME_LIB.into());
    if !std::path::Path::new(&lib).exists() {
        fail(&format!("{lib} is missing: install Debian's faketime package (or name the library in FAKETIME_LIB)"));
    }
    // libfaketime reads fractions of a second from its offset in seconds.
    let seconds = offset.trim_end_matches("ms").parse::<f64>().unwrap() / 1000.0;
    vec![
        ("LD_PRELOAD".into(), lib),
        ("FAKETIME".into(), format!("{seconds:+}")),
        // Only the wall clock differs between machines: waits keep their length.
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ]
}

/// What the faults did: how many of each kind, the keys of the slow calls that saturated the
/// workers and of the calls that timed a failover, and how long each failover kept new keys
/// from being answered.
struct Injected {
    counts: BTreeMap<&'static str, u32>,
    slow: Vec<String>,
    failovers: Vec<Duration>,
}

/// Injects one fault after another until `stop_at`, then leaves every node running.
async fn faults(
    nodes: Arc<Mutex<Vec<Node>>>,
    run: Run,
    store: String,
    urls: Vec<String>,
    stop_at: Instant,
) -> Injected {
    let mut rng = StdRng::seed_from_u64(7);
    let mut injected = Injected { counts: BTreeMap::new(), slow: Vec::new(), failovers: Vec::new() };
    let kinds: &[&'static str] = match run {
        Run::Postgres => &["kill", "pause", "saturate", "stall store", "restart store", "long pause", "kill backend"],
        Run::Sqlite => &["kill", "pause", "saturate", "stall store", "long pause"],
        Run::Failover => &["kill", "failover", "pause", "saturate", "long pause"],
    };
    let mut turn = 0;
    while Instant::now() + 2 * LEASE < stop_at {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(1_000..2_500))).await;
        let kind = kinds[turn % kinds.len()];
        turn += 1;
        let victim = rng.gen_range(0..urls.len());
        match kind {
            "kill" => {
                nodes.lock().await[victim].kill();
                tokio::time::sleep(LEASE + LEASE / 2).await;
                nodes.lock().await[victim].restart().await;
            }
            "pause" => {
                let pid = nodes.lock().await[victim].pid().unwrap();
                signal("-STOP", pid);
                tokio::time::sleep(LEASE * 5 / 2).await;
                signal("-CONT", pid);
            }
            "long pause" => {
                let pid = nodes.lock().await[victim].pid().unwrap();
                signal("-STOP", pid);
                tokio::time::sleep(LONG_PAUSE).await;
                signal("-CONT", pid);
            }
            "kill backend" => kill_backend(&store).await,
            "saturate" => injected.slow.extend(saturate(&urls, &mut rng).await),
            "stall store" => stall(run, &store, 2 * LEASE).await,
            "restart store" => restart_postgres(&store).await,
            "failover" => {
                pair("failover").await;
                let (took, keys) = next_new_key(&urls, injected.failovers.len()).await;
                injected.failovers.push(took);
                injected.slow.extend(keys);
                // The old primary back as the new one's synchronous standby, for the next.
                pair("rebuild").await;
            }
            _ => unreachable!(),
        }
        *injected.counts.entry(kind).or_insert(0) += 1;
    }
    injected
}

/// Sends new keys, one after another to each node in turn, until one is answered 201: how long
/// that took from now (just after a promotion), and the keys sent.
async fn next_new_key(urls: &[String], failover: usize) -> (Duration, Vec<String>) {
    let http = reqwest::Client::builder().no_proxy().timeout(CLIENT_TIMEOUT).build().unwrap();
    let start = Instant::now();
    let mut keys = Vec::new();
    for n in 0.. {
        let key = format!("after-failover-{failover}-{n}");
        let url = &urls[n % urls.len()];
        let answer = common::keyed_post(&http, url, "/payments?delay_ms=0", &key, "{}").send().await;
        keys.push(key);
        if answer.is_ok_and(|a| a.status() == 201) {
            break;
        }
        assert!(start.elapsed() < SETTLE, "no new key answered within {SETTLE:?} of a promotion");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (start.elapsed(), keys)
}

fn signal(which: &str, pid: u32) {
    let sent = Command::new("kill").arg(which).arg(pid.to_string()).status().unwrap();
    assert!(sent.success(), "kill {which} {pid} failed");
}

/// Sends every node more calls than it has workers, each taking two and a half leases, under
/// keys of their own that nobody retries: every worker stays busy past two leases. The keys.
async fn saturate(urls: &[String], rng: &mut StdRng) -> Vec<String> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_millis(200)).build().unwrap();
    let batch: u32 = rng.gen();
    let mut keys = Vec::new();
    for (n, url) in urls.iter().enumerate() {
        for i in 0..2 * CONCURRENCY {
            let key = format!("slow-{batch}-{n}-{i}");
            let path = format!("/payments?delay_ms={}", (LEASE * 5 / 2).as_millis());
            let request = common::keyed_post(&http, url, &path, &key, "{}");
            // Answered or not, the call is recorded and runs on.
            let _ = request.header("prefer", "respond-async").send().await;
            keys.push(key);
        }
    }
    keys
}

/// Holds the store still for `how_long`: SQLite's file under an exclusive lock, PostgreSQL's
/// `records` table under an access-exclusive one. Every write (and on PostgreSQL, every read)
/// waits for it.
async fn stall(run: Run, store: &str, how_long: Duration) {
    match run {
        Run::Sqlite => {
            let path = store.trim_start_matches("sqlite://").to_string();
            tokio::task::spawn_blocking(move || {
                let conn = rusqlite::Connection::open(path).unwrap();
                conn.busy_timeout(Duration::from_secs(10)).unwrap();
                conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
                std::thread::sleep(how_long);
                conn.execute_batch("COMMIT").unwrap();
            })
            .await
            .unwrap();
        }
        Run::Postgres | Run::Failover => {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(store).await.unwrap();
            sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
            sqlx::query("LOCK TABLE records IN ACCESS EXCLUSIVE MODE").execute(&mut conn).await.unwrap();
            tokio::time::sleep(how_long).await;
            sqlx::query("COMMIT").execute(&mut conn).await.unwrap();
        }
    }
}

/// Kills (SIGKILL) one backend serving the run's database: the server then ends every backend
/// and recovers from its log, as it does when the OOM killer takes one. The server runs on this
/// machine, as the soak's does.
async fn kill_backend(store: &str) {
    use sqlx::Connection;
    let server = backend::postgres_server_url().unwrap();
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    let name = store.rsplit('/').next().unwrap().to_string();
    let pid: Option<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() ORDER BY backend_start LIMIT 1",
    )
    .bind(name)
    .fetch_optional(&mut admin)
    .await
    .unwrap();
    drop(admin);
    if let Some(pid) = pid {
        signal("-KILL", pid as u32);
    }
    // The server refuses connections while it recovers.
    tokio::time::sleep(Duration::from_secs(2)).await;
}

/// Restarts the PostgreSQL server with `IDEM_SOAK_PG_RESTART`, or, without it, ends every
/// connection to the run's database (what its nodes see of a restart).
async fn restart_postgres(store: &str) {
    if let Ok(command) = std::env::var("IDEM_SOAK_PG_RESTART") {
        let done = tokio::task::spawn_blocking(move || Command::new("sh").arg("-c").arg(&command).status().unwrap());
        let status = done.await.unwrap();
        assert!(status.success(), "IDEM_SOAK_PG_RESTART failed: {status}");
        return;
    }
    use sqlx::Connection;
    let server = backend::postgres_server_url().unwrap();
    let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
    let name = store.rsplit('/').next().unwrap().to_string();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(name)
        .execute(&mut admin)
        .await
        .unwrap();
}

/// Every key against the upstream's ledger and its record, once nothing is left in progress.
async fn audit(node: &Node, upstream: &Upstream, ended: &BTreeMap<String, Vec<Ended>>) -> Report {
    let mut r = Report { operations: ended.len(), ..Report::default() };
    for (key, ends) in ended {
        let hits = upstream.hits(key);
        r.executions += hits;
        if hits > 1 {
            r.doubles += hits - 1;
            r.problems.push(format!("{key}: executed {hits} times"));
        }
        let record = settled(node, key).await;
        let state = record.as_ref().map(|r| r["state"].as_str().unwrap_or("?").to_string());
        match state.as_deref() {
            Some("done") => r.done += 1,
            Some("unknown") => r.unknown += 1,
            Some("not_started") => r.free += 1,
            None => r.never_recorded += 1,
            Some(other) => r.problems.push(format!("{key}: left {other}")),
        }
        for end in ends {
            match end {
                Ended::Acknowledged(bytes) => {
                    let kept = record.as_ref().filter(|r| r["state"] == "done").map(|r| r["response"]["body"].clone());
                    if kept != Some(serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned())) {
                        r.lost += 1;
                        r.problems.push(format!("{key}: a client got 201 {bytes:?}; the record keeps {kept:?}"));
                    }
                }
                Ended::Unknown => {}
                Ended::GaveUp(last) => {
                    r.unsettled += 1;
                    r.problems.push(format!("{key}: no outcome before the settle ran out; last {last}"));
                }
                Ended::Unexpected(status, body) => {
                    r.problems.push(format!("{key}: answered {status} {:?}", String::from_utf8_lossy(body)))
                }
            }
        }
    }
    r
}

/// The record of `key` once it is neither queued nor in progress (or as it stands after 30 s).
async fn settled(node: &Node, key: &str) -> Option<serde_json::Value> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let record = node.record(key).await;
        let busy = record.as_ref().is_some_and(|r| r["state"] == "in_progress" || r["queued"] == true);
        if !busy || Instant::now() > until {
            return record;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
