//! Load benchmark: what Idem costs over a plain reverse proxy, measured in one run on one machine.
//!
//! Everything runs in this process on 127.0.0.1: a fast upstream (axum, `201` + ~60 bytes of
//! JSON), a plain reverse proxy (axum + a shared `reqwest::Client`, no recording) as the
//! baseline, nginx as a second one when it is on the PATH (Debian's `nginx-light`: the proxy
//! Idem's figures are judged against from outside), and Idem started with `idem::server::start` once per store (SQLite with
//! `synchronous=FULL`, SQLite with `synchronous=NORMAL`, and PostgreSQL when
//! `IDEM_BENCH_POSTGRES_URL` or `IDEM_TEST_POSTGRES_URL` is set). Each target is driven by the same
//! closed-loop generator: N tasks, one keep-alive `reqwest::Client` each, sending POSTs back to
//! back for a fixed time after a warm-up, at concurrency 1, 8 and 64.
//!
//! Cases: the plain proxy; Idem with a fresh `Idempotency-Key` per request; Idem replaying keys
//! that were created during the warm-up. Every answered request's latency goes into an HDR
//! histogram; non-2xx answers (and, for replays, answers without `Idempotent-Replayed: true`)
//! and transport failures are counted as errors and printed.
//!
//! The cases take turns: each case's measured time is cut into slices, and every round gives
//! each case one slice (the proxy included), so all of them are measured over the same stretch of
//! the run, and a shared machine's slow minute weighs on all alike. Each slice opens fresh
//! connections and warms up before it counts. With `pgbench` on the PATH and a PostgreSQL store,
//! each round also runs `pgbench -N` on the same server for a slice, at the same concurrency.
//! Then the proxy and Idem's new keys are driven, one after the other, in an open loop at half
//! the proxy's closed-loop maximum.
//!
//! `IDEM_BENCH_SECS` (default 5) sets the measured seconds per case, `IDEM_BENCH_ROUNDS`
//! (default 5) the slices it is cut into, and `IDEM_BENCH_WARMUP_SECS` (default 0.5) the warm-up
//! before each slice (and before the open loop); `IDEM_BENCH_STORES` (default
//! `full,normal,postgres`) picks the stores. No log subscriber is installed, so Idem's spans and
//! log lines cost next to nothing; `IDEM_BENCH_LOGS=1` installs what `idem serve` logs by default
//! to a file (text at `info`: the access line, a line per attempt and per settlement), written as
//! it writes them, to a sink, to price them. Run
//! with `cargo bench --bench load`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use hdrhistogram::Histogram;
use idem::config::Config;
use sqlx::Connection;
use tokio::net::TcpListener;

#[path = "support/nginx.rs"]
mod nginx;

/// The request body every case sends (the same bytes, so replays match their fingerprint).
const REQUEST_BODY: &str = r#"{"amount":1000,"currency":"eur","customer":"cus_bench"}"#;
/// The upstream's answer to every request.
const UPSTREAM_BODY: &str = r#"{"id":"pay_bench_000001","status":"succeeded","amount":1000}"#;
const CONCURRENCIES: [usize; 3] = [1, 8, 64];
/// Keys a replay task creates during its warm-up, at most.
const MAX_REPLAY_KEYS: usize = 4096;

// ---- settings and machine ---------------------------------------------------------------------

struct Settings {
    measure: Duration,
    warmup: Duration,
    /// Which stores to run Idem on: `full`, `normal`, `postgres`.
    stores: Vec<String>,
    /// How many slices each case's measured time is cut into.
    rounds: usize,
}

fn stores_from_env() -> Vec<String> {
    let text = std::env::var("IDEM_BENCH_STORES").unwrap_or_default();
    let text = if text.trim().is_empty() { "full,normal,postgres" } else { text.trim() };
    let stores: Vec<String> = text.split(',').map(|s| s.trim().to_ascii_lowercase()).collect();
    for store in &stores {
        if !["full", "normal", "postgres"].contains(&store.as_str()) {
            panic!("IDEM_BENCH_STORES: `{store}` is not one of full, normal, postgres");
        }
    }
    stores
}

fn rounds_from_env() -> usize {
    match std::env::var("IDEM_BENCH_ROUNDS") {
        Ok(text) if !text.trim().is_empty() => match text.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => panic!("IDEM_BENCH_ROUNDS={text:?} is not a positive whole number"),
        },
        _ => 5,
    }
}

fn seconds_from_env(name: &str, default: f64) -> Duration {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => match text.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s >= 0.0 => Duration::from_secs_f64(s),
            _ => panic!("{name}={text:?} is not a number of seconds"),
        },
        _ => Duration::from_secs_f64(default),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The p50 of appending 4 KiB to a file in `dir` and syncing it: the floor under each commit
/// that `synchronous=FULL` makes durable.
fn fsync_p50(dir: &std::path::Path) -> u64 {
    use std::io::Write;
    let path = dir.join("fsync-probe");
    let mut file = std::fs::File::create(&path).unwrap();
    let mut took: Vec<u64> = (0..200)
        .map(|_| {
            let start = Instant::now();
            file.write_all(&[0u8; 4096]).unwrap();
            file.sync_data().unwrap();
            start.elapsed().as_micros() as u64
        })
        .collect();
    let _ = std::fs::remove_file(path);
    took.sort_unstable();
    took[took.len() / 2]
}

// ---- the fast upstream -------------------------------------------------------------------------

async fn start_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(|_body: Bytes| async {
        (StatusCode::CREATED, [(header::CONTENT_TYPE, "application/json")], UPSTREAM_BODY)
    });
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

// ---- the plain reverse proxy (baseline) ---------------------------------------------------------

struct Proxy {
    upstream: String,
    client: reqwest::Client,
}

/// Headers that belong to one connection (plus `host` and `content-length`, which the client
/// recomputes), never forwarded either way.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

async fn forward(State(proxy): State<Arc<Proxy>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let path = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let mut headers = parts.headers;
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::HOST);
    let sent = proxy
        .client
        .request(parts.method, format!("{}{}", proxy.upstream, path))
        .headers(headers)
        .body(body)
        .send()
        .await;
    let Ok(answer) = sent else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    let status = answer.status();
    let mut headers = answer.headers().clone();
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    let Ok(body) = answer.bytes().await else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

async fn start_proxy(upstream: &str) -> String {
    // The same client settings as Idem's own upstream client.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(Duration::from_secs(5))
        .pool_idle_timeout(Duration::from_secs(30))
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let proxy = Arc::new(Proxy { upstream: upstream.to_string(), client });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(forward).with_state(proxy);
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

// ---- Idem --------------------------------------------------------------------------------------

fn idem_config(store_url: &str, upstream: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[store]
url = "{store_url}"

[[routes]]
name = "payments"
path_prefix = "/payments"
upstream = "{upstream}"
methods = ["POST"]

[worker]
concurrency = 256
"#
    )
}

/// A fresh database on the PostgreSQL server at `server_url`: its URL and its name.
async fn create_postgres_database(server_url: &str) -> Result<(String, String), String> {
    let name = format!("idem_bench_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(server_url).await.map_err(|e| format!("cannot connect: {e}"))?;
    let create = format!("CREATE DATABASE {name}");
    sqlx::raw_sql(&create).execute(&mut conn).await.map_err(|e| format!("cannot create database {name}: {e}"))?;
    let _ = conn.close().await;
    let mut url = reqwest::Url::parse(server_url).map_err(|e| format!("bad URL: {e}"))?;
    url.set_path(&format!("/{name}"));
    Ok((url.to_string(), name))
}

async fn drop_postgres_database(server_url: &str, name: &str) -> Result<(), String> {
    let mut conn = sqlx::PgConnection::connect(server_url).await.map_err(|e| e.to_string())?;
    let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
    sqlx::raw_sql(&drop).execute(&mut conn).await.map_err(|e| e.to_string())?;
    let _ = conn.close().await;
    Ok(())
}

// ---- the closed-loop load generator -------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// No Idempotency-Key (the plain proxy does not need one).
    None,
    /// A fresh key per request.
    Fresh,
    /// Keys created during the warm-up, replayed during the measurement.
    Replay,
}

struct Measured {
    latency_us: Histogram<u64>,
    requests: u64,
    errors: u64,
    error_samples: Vec<String>,
    elapsed: Duration,
    /// CPU time this process used meanwhile, all threads together.
    cpu: Duration,
}

impl Measured {
    fn empty() -> Measured {
        Measured {
            latency_us: histogram(),
            requests: 0,
            errors: 0,
            error_samples: Vec::new(),
            elapsed: Duration::ZERO,
            cpu: Duration::ZERO,
        }
    }

    /// Adds one slice of the same case.
    fn merge(&mut self, slice: Measured) {
        self.cpu += slice.cpu;
        self.latency_us.add(&slice.latency_us).unwrap();
        self.requests += slice.requests;
        self.errors += slice.errors;
        self.elapsed += slice.elapsed;
        for sample in slice.error_samples {
            if self.error_samples.len() < 5 && !self.error_samples.contains(&sample) {
                self.error_samples.push(sample);
            }
        }
    }

    fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

struct TaskResult {
    latency_us: Histogram<u64>,
    requests: u64,
    errors: u64,
    error_samples: Vec<String>,
    started: Instant,
    finished: Instant,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).unwrap()
}

enum Sent {
    /// A 2xx answer (for replays: one marked as replayed).
    Ok,
    /// Answered, but not as expected.
    Bad(String),
    /// No answer at all.
    Failed(String),
}

async fn send_one(client: &reqwest::Client, url: &str, key: Option<&str>, replay: bool) -> Sent {
    let mut request = client.post(url).header(header::CONTENT_TYPE, "application/json").body(REQUEST_BODY);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let answer = match request.send().await {
        Ok(a) => a,
        Err(e) => return Sent::Failed(format!("transport: {e}")),
    };
    let status = answer.status();
    let replayed = answer.headers().get("idempotent-replayed").is_some_and(|v| v.as_bytes() == b"true");
    let body = match answer.bytes().await {
        Ok(b) => b,
        Err(e) => return Sent::Failed(format!("reading body: {e}")),
    };
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        Sent::Bad(format!("{status}: {text}"))
    } else if replay && !replayed {
        Sent::Bad(format!("{status} without Idempotent-Replayed: true"))
    } else {
        Sent::Ok
    }
}

async fn client_task(
    url: Arc<str>,
    keys: Keys,
    key_prefix: String,
    warmup_until: Instant,
    measure: Duration,
) -> TaskResult {
    let client =
        reqwest::Client::builder().no_proxy().tcp_nodelay(true).timeout(Duration::from_secs(30)).build().unwrap();
    let mut counter = 0u64;
    let mut fresh_key = || {
        counter += 1;
        format!("{key_prefix}-{counter}")
    };

    // Warm-up: connections opened, caches and pools filled; for replays, the keys created.
    let mut created: Vec<String> = Vec::new();
    while Instant::now() < warmup_until {
        let key = (keys != Keys::None).then(&mut fresh_key);
        let ok = matches!(send_one(&client, &url, key.as_deref(), false).await, Sent::Ok);
        if ok && keys == Keys::Replay && created.len() < MAX_REPLAY_KEYS {
            created.extend(key);
        }
        if !ok {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    if keys == Keys::Replay && created.is_empty() {
        for _ in 0..10 {
            let key = fresh_key();
            if let Sent::Ok = send_one(&client, &url, Some(&key), false).await {
                created.push(key);
                break;
            }
        }
        if created.is_empty() {
            created.push(fresh_key()); // replays of it will fail and be counted as errors
        }
    }

    let mut result = TaskResult {
        latency_us: histogram(),
        requests: 0,
        errors: 0,
        error_samples: Vec::new(),
        started: Instant::now(),
        finished: Instant::now(),
    };
    let until = result.started + measure;
    let mut n = 0usize;
    while Instant::now() < until {
        let key = match keys {
            Keys::None => None,
            Keys::Fresh => Some(fresh_key()),
            Keys::Replay => Some(created[n % created.len()].clone()),
        };
        n += 1;
        let start = Instant::now();
        let sent = send_one(&client, &url, key.as_deref(), keys == Keys::Replay).await;
        let took = start.elapsed();
        let problem = match sent {
            Sent::Ok => None,
            Sent::Bad(p) => Some(p),
            Sent::Failed(p) => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                result.errors += 1;
                if result.error_samples.len() < 3 {
                    result.error_samples.push(p);
                }
                continue;
            }
        };
        result.latency_us.saturating_record((took.as_micros() as u64).max(1));
        result.requests += 1;
        if let Some(p) = problem {
            result.errors += 1;
            if result.error_samples.len() < 3 {
                result.error_samples.push(p);
            }
        }
    }
    result.finished = Instant::now();
    result
}

/// One closed-loop slice: `concurrency` tasks warm up for `warmup`, then count for `measure`.
async fn drive(url: &str, keys: Keys, concurrency: usize, warmup: Duration, measure: Duration) -> Measured {
    let url: Arc<str> = Arc::from(url);
    let run = uuid::Uuid::new_v4().simple().to_string();
    let warmup_until = Instant::now() + warmup;
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            tokio::spawn(client_task(url.clone(), keys, format!("bench-{}-{i}", &run[..12]), warmup_until, measure))
        })
        .collect();
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(warmup_until.into()).await;
        let before = process_cpu();
        tokio::time::sleep(measure).await;
        process_cpu().saturating_sub(before)
    });
    let mut measured = Measured::empty();
    let mut first_start: Option<Instant> = None;
    let mut last_finish: Option<Instant> = None;
    for task in tasks {
        let r = task.await.expect("a client task panicked");
        measured.latency_us.add(&r.latency_us).unwrap();
        measured.requests += r.requests;
        measured.errors += r.errors;
        for s in r.error_samples {
            if measured.error_samples.len() < 5 && !measured.error_samples.contains(&s) {
                measured.error_samples.push(s);
            }
        }
        first_start = Some(first_start.map_or(r.started, |f| f.min(r.started)));
        last_finish = Some(last_finish.map_or(r.finished, |l| l.max(r.finished)));
    }
    measured.elapsed = last_finish.unwrap() - first_start.unwrap();
    measured.cpu = cpu.await.unwrap();
    measured
}

/// CPU time this process has used so far, every thread's (user and system), from
/// `/proc/self/stat`; zero where there is no such file.
fn process_cpu() -> Duration {
    /// Linux counts these times in ticks of 1/100 s (`USER_HZ`).
    const TICK: Duration = Duration::from_millis(10);
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return Duration::ZERO };
    // The fields after the command name, which is in parentheses and may hold spaces: the 14th
    // and 15th of the line (utime, stime) are the 12th and 13th of these.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u32>().ok()).unwrap_or(0);
    TICK * (ticks(11) + ticks(12))
}

/// The most memory this process has held resident (`VmHWM`), where Linux says.
fn peak_resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

// ---- the open-loop load generator ---------------------------------------------------------------

/// Most requests outstanding at once in the open loop; a request due while this many are
/// unanswered is counted as an error (the target cannot keep up with the rate).
const OPEN_LOOP_IN_FLIGHT: usize = 256;

/// Sends requests at a fixed `rate` (per second) whatever the answers do, for the measured
/// time after a warm-up at the same rate. Latency counts from when a request was *due*, so a
/// target that falls behind pays for its queue (no coordinated omission).
async fn drive_open(url: &str, keys: Keys, rate: f64, settings: &Settings) -> Measured {
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(OPEN_LOOP_IN_FLIGHT)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url: Arc<str> = Arc::from(url);
    let run = uuid::Uuid::new_v4().simple().to_string();
    let latency = Arc::new(std::sync::Mutex::new(histogram()));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(OPEN_LOOP_IN_FLIGHT));
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let measure_from = start + settings.warmup;
    let end = measure_from + settings.measure;
    let mut due = start;
    let mut n = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    while due < end {
        tokio::time::sleep_until(due.into()).await;
        // Everything due by now goes out, so a coarse timer does not lower the rate.
        while due <= Instant::now() && due < end {
            let scheduled = due;
            due += interval;
            n += 1;
            let measured = scheduled >= measure_from;
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                if measured {
                    errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                continue;
            };
            let key = (keys == Keys::Fresh).then(|| format!("open-{}-{n}", &run[..12]));
            let (client, url, latency, errors, answered) =
                (client.clone(), url.clone(), latency.clone(), errors.clone(), answered.clone());
            tasks.spawn(async move {
                let sent = send_one(&client, &url, key.as_deref(), false).await;
                let took = scheduled.elapsed();
                drop(permit);
                if !measured {
                    return;
                }
                match sent {
                    Sent::Ok => {
                        answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let us = (took.as_micros() as u64).clamp(1, 120_000_000);
                        latency.lock().unwrap().record(us).unwrap();
                    }
                    _ => {
                        errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    let latency_us = latency.lock().unwrap().clone();
    Measured {
        latency_us,
        requests: answered.load(std::sync::atomic::Ordering::Relaxed),
        errors: errors.load(std::sync::atomic::Ordering::Relaxed),
        elapsed: settings.measure,
        ..Measured::empty()
    }
}

// ---- the cases and the table -------------------------------------------------------------------

/// What the generator drives: the plain proxy, or Idem on one store with new keys or replays.
struct Target {
    name: &'static str,
    store: String,
    url: String,
    keys: Keys,
}

struct Row {
    target: &'static str,
    store: String,
    concurrency: usize,
    measured: Measured,
}

/// Drives every target at each concurrency, in rounds: each round gives each target one slice
/// of its measured time, in turn, starting one target further on each round. A target's figures
/// add up its slices, so the proxy and Idem are measured across the same stretch of time and a
/// machine that speeds up or slows down part-way through the run favours none of them. With
/// `pgbench`, each round also runs `pgbench -N` for a slice at the same concurrency: (c, tps).
async fn run_rounds(
    targets: &[Target],
    pgbench: Option<&Pgbench>,
    settings: &Settings,
) -> (Vec<Row>, Vec<(usize, f64)>) {
    let slice = settings.measure / settings.rounds as u32;
    let mut rows = Vec::new();
    let mut pgbench_tps = Vec::new();
    for c in CONCURRENCIES {
        let first = rows.len();
        for target in targets {
            let (target, store) = (target.name, target.store.clone());
            rows.push(Row { target, store, concurrency: c, measured: Measured::empty() });
        }
        let mut tps = Ok(Vec::new());
        for round in 0..settings.rounds {
            for i in 0..targets.len() {
                let t = (i + round) % targets.len();
                let measured = drive(&targets[t].url, targets[t].keys, c, settings.warmup, slice).await;
                rows[first + t].measured.merge(measured);
            }
            if let (Some(pgbench), Ok(found)) = (pgbench, &mut tps) {
                match pgbench.tps(c, slice).await {
                    Ok(one) => found.push(one),
                    Err(e) => tps = Err(e),
                }
            }
        }
        for row in &rows[first..] {
            report_case(row);
        }
        match tps {
            Ok(found) if !found.is_empty() => {
                let mean = found.iter().sum::<f64>() / found.len() as f64;
                println!("  pgbench -N c={c}: {mean:.0} tps");
                pgbench_tps.push((c, mean));
            }
            Ok(_) => {}
            Err(e) => println!("  pgbench -N c={c} skipped: {e}"),
        }
    }
    (rows, pgbench_tps)
}

fn report_case(row: &Row) {
    let m = &row.measured;
    let label = format!("{} [{}] c={}", row.target, row.store, row.concurrency);
    println!(
        "  {label:<40} {:>9.0} req/s  p50 {:>6} us  errors {}",
        m.per_second(),
        m.latency_us.value_at_quantile(0.5),
        m.errors
    );
    if m.errors > 0 {
        println!(
            "    ERRORS in {label}: {} of {} requests failed or answered unexpectedly; e.g.:",
            m.errors,
            m.requests + m.errors
        );
        for sample in &m.error_samples {
            println!("      {sample}");
        }
    }
}

/// The open loop runs at half the plain proxy's closed-loop maximum (its c=64 throughput).
fn open_rate(rows: &[Row]) -> Option<f64> {
    rows.iter().find(|r| r.target == "plain proxy" && r.concurrency == 64).map(|r| r.measured.per_second() / 2.0)
}

/// The open-loop table: latency at a fixed rate, and the p99 added to the proxy's at that rate.
fn print_open_table(rows: &[Row], rate: f64) {
    let proxy_p99 =
        rows.iter().find(|r| r.target == "plain proxy").map(|r| r.measured.latency_us.value_at_quantile(0.99) as i64);
    println!();
    println!("open loop at {rate:.0} requests/s (half the plain proxy's maximum), latency from when each was due:");
    println!(
        "{:<14} {:<14} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "target", "store", "answered/s", "p50 us", "p99 us", "p99.9 us", "errors", "+p99 us"
    );
    println!("{}", "-".repeat(90));
    for row in rows {
        let m = &row.measured;
        let p99 = m.latency_us.value_at_quantile(0.99) as i64;
        println!(
            "{:<14} {:<14} {:>10.0} {:>9} {:>9} {:>9} {:>9} {:>9}",
            row.target,
            row.store,
            m.per_second(),
            m.latency_us.value_at_quantile(0.5),
            p99,
            m.latency_us.value_at_quantile(0.999),
            m.errors,
            proxy_p99.map_or("-".into(), |b| format!("{:+}", p99 - b))
        );
    }
}

fn print_table(rows: &[Row]) {
    let proxy = |c: usize| rows.iter().find(|r| r.target == "plain proxy" && r.concurrency == c).map(|r| &r.measured);
    let nginx = |c: usize| rows.iter().find(|r| r.target == "nginx" && r.concurrency == c).map(|r| &r.measured);
    println!();
    println!(
        "{:<14} {:<14} {:>3} {:>10} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8} {:>9} {:>8}",
        "target",
        "store",
        "c",
        "req/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "errors",
        "x proxy",
        "x nginx",
        "+p50 us",
        "cpu us"
    );
    println!("{}", "-".repeat(119));
    for row in rows {
        let m = &row.measured;
        let base = proxy(row.concurrency);
        let times = |b: Option<&Measured>| {
            b.map(|b| format!("{:.2}", m.per_second() / b.per_second().max(1e-9))).unwrap_or_else(|| "-".into())
        };
        let (ratio, to_nginx) = (times(base), times(nginx(row.concurrency)));
        let added = match base {
            Some(b) if row.concurrency == 1 => {
                format!("{:+}", m.latency_us.value_at_quantile(0.5) as i64 - b.latency_us.value_at_quantile(0.5) as i64)
            }
            _ => "-".into(),
        };
        let cpu = m.cpu.as_secs_f64() * 1e6 / m.requests.max(1) as f64;
        println!(
            "{:<14} {:<14} {:>3} {:>10.0} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8} {:>9} {:>8.0}",
            row.target,
            row.store,
            row.concurrency,
            m.per_second(),
            m.latency_us.value_at_quantile(0.5),
            m.latency_us.value_at_quantile(0.99),
            m.latency_us.value_at_quantile(0.999),
            m.errors,
            ratio,
            to_nginx,
            added,
            cpu
        );
    }
}

async fn bench(settings: Settings) {
    println!("idem load benchmark");
    println!("machine: nproc {}, cpu {}", nproc(), cpu_model());
    println!(
        "per case: {:.1}s measured in {} slices of {:.1}s, each after a {:.1}s warm-up, interleaved with \
         the other cases; closed loop, one keep-alive client per task; load generator, proxies and \
         upstream share this process and its cores",
        settings.measure.as_secs_f64(),
        settings.rounds,
        settings.measure.as_secs_f64() / settings.rounds as f64,
        settings.warmup.as_secs_f64(),
    );

    let upstream = start_upstream().await;
    let proxy = start_proxy(&upstream).await;
    let mut notes = Vec::new();
    let mut targets =
        vec![Target { name: "plain proxy", store: "-".into(), url: format!("{proxy}/payments"), keys: Keys::None }];
    let nginx = match nginx::start(&upstream, nginx::Buffering::Default).await {
        Ok(nginx) => {
            println!("nginx on {}", nginx.url);
            targets.push(Target {
                name: "nginx",
                store: "-".into(),
                url: format!("{}/payments", nginx.url),
                keys: Keys::None,
            });
            Some(nginx)
        }
        Err(e) => {
            notes.push(format!("nginx rows skipped: {e}"));
            None
        }
    };

    // SQLite files live under the target directory (a real disk), not a possibly in-memory /tmp.
    let dir = tempfile::Builder::new().prefix("idem-load-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    println!("SQLite files under {}", dir.path().display());
    let fsync = fsync_p50(dir.path());
    println!("this disk: one 4 KiB write + fdatasync, p50 {fsync} us (SQLite FULL pays one per commit)");
    let mut stores = Vec::new();
    for (store, query) in [("sqlite FULL", ""), ("sqlite NORMAL", "?synchronous=normal")] {
        if settings.stores.iter().any(|s| store.eq_ignore_ascii_case(&format!("sqlite {s}"))) {
            let sub = dir.path().join(store.replace(' ', "-"));
            std::fs::create_dir_all(&sub).unwrap();
            stores.push((store.to_string(), format!("sqlite://{}{query}", sub.join("idem.db").display())));
        }
    }

    let postgres = std::env::var("IDEM_BENCH_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .map(|u| ("IDEM_BENCH_POSTGRES_URL", u))
        .or_else(|| {
            std::env::var("IDEM_TEST_POSTGRES_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .map(|u| ("IDEM_TEST_POSTGRES_URL", u))
        });
    // Databases created for this run, dropped at its end: (server, name).
    let mut databases = Vec::new();
    let mut pgbench = None;
    match postgres.filter(|_| settings.stores.iter().any(|s| s == "postgres")) {
        None if !settings.stores.iter().any(|s| s == "postgres") => {}
        None => notes
            .push("postgres rows skipped: neither IDEM_BENCH_POSTGRES_URL nor IDEM_TEST_POSTGRES_URL is set".into()),
        Some((var, server)) => {
            match create_postgres_database(&server).await {
                Err(e) => notes.push(format!("postgres rows skipped ({var}): {e}")),
                Ok((url, name)) => {
                    println!("postgres: fresh database {name}, from {var}");
                    stores.push(("postgres".to_string(), url));
                    databases.push((server.clone(), name));
                }
            }
            match Pgbench::prepare(&server).await {
                Ok(found) => {
                    databases.push((server.clone(), found.database.clone()));
                    pgbench = Some(found);
                }
                Err(e) => notes.push(format!("pgbench comparison skipped: {e}")),
            }
        }
    }

    let mut brokers = Vec::new();
    for (store, url) in stores {
        let config = match Config::parse_with_env(&idem_config(&url, &upstream), |_| None) {
            Ok(config) => config,
            Err(e) => {
                notes.push(format!("{store} rows skipped: config refused: {e}"));
                continue;
            }
        };
        match idem::server::start(config).await {
            Ok(running) => {
                println!("idem on {store} ({url})");
                let url = format!("http://{}/payments", running.listen);
                targets.push(Target {
                    name: "idem new keys",
                    store: store.clone(),
                    url: url.clone(),
                    keys: Keys::Fresh,
                });
                targets.push(Target { name: "idem replays", store: store.clone(), url, keys: Keys::Replay });
                brokers.push((store, running));
            }
            Err(e) => notes.push(format!("{store} rows skipped: idem did not start: {e}")),
        }
    }

    let (rows, pgbench_tps) = run_rounds(&targets, pgbench.as_ref(), &settings).await;

    let mut open_rows = Vec::new();
    if let Some(rate) = open_rate(&rows) {
        for target in targets.iter().filter(|t| t.keys != Keys::Replay) {
            let measured = drive_open(&target.url, target.keys, rate, &settings).await;
            println!(
                "  {} [{}] open loop at {rate:.0}/s: p99 {} us",
                target.name,
                target.store,
                measured.latency_us.value_at_quantile(0.99)
            );
            open_rows.push(Row { target: target.name, store: target.store.clone(), concurrency: 0, measured });
        }
    }

    for (store, running) in brokers {
        if tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await.is_err() {
            println!("  (idem on {store} did not shut down within 10s; going on)");
        }
    }
    for (server, name) in databases {
        if let Err(e) = drop_postgres_database(&server, &name).await {
            println!("  could not drop database {name}: {e}");
        }
    }
    drop(dir);
    drop(nginx);

    let errors: u64 = rows.iter().map(|r| r.measured.errors).sum();
    println!();
    for note in &notes {
        println!("note: {note}");
    }
    if errors > 0 {
        println!("note: {errors} requests failed or answered unexpectedly in total (see ERRORS above)");
    }
    if let Some(kib) = peak_resident_kib() {
        println!("peak resident memory of this process (every target, generator and upstream): {} MiB", kib / 1024);
    }
    println!(
        "x proxy, x nginx: throughput / the plain proxy's (or nginx's) at the same c; +p50 us: p50 minus the plain proxy's \
         (c=1 only); cpu us: this process's CPU time per answered request, generator and upstream \
         included (a PostgreSQL server's and nginx's are not); latencies of every answered request, in microseconds"
    );
    if let Some(rate) = open_rate(&rows) {
        print_open_table(&open_rows, rate);
    }
    print_pgbench(&rows, &pgbench_tps);
    print_table(&rows);
}

/// `pgbench -N` (its simple-update transaction: three statements and a commit) on its own fresh
/// database of the PostgreSQL server Idem uses.
struct Pgbench {
    url: String,
    database: String,
}

impl Pgbench {
    async fn prepare(server: &str) -> Result<Pgbench, String> {
        let (url, database) = create_postgres_database(server).await?;
        let pgbench = Pgbench { url, database };
        if let Err(e) = pgbench.run(&["-i", "-q", "-s", "10"]).await {
            let _ = drop_postgres_database(server, &pgbench.database).await;
            return Err(e);
        }
        Ok(pgbench)
    }

    async fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = tokio::process::Command::new("pgbench")
            .args(args)
            .arg(&self.url)
            .output()
            .await
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        if !out.status.success() {
            return Err(format!("pgbench {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Transactions per second at `clients` over `duration` (whole seconds, at least one).
    async fn tps(&self, clients: usize, duration: Duration) -> Result<f64, String> {
        let (clients, secs) = (clients.to_string(), duration.as_secs().max(1).to_string());
        let text = self.run(&["-N", "-c", &clients, "-j", "2", "-T", &secs]).await?;
        text.lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
            .ok_or_else(|| "no `tps = ` line in pgbench's output".to_string())
    }
}

/// Idem's new keys on PostgreSQL against `pgbench -N` on the same server and concurrency.
fn print_pgbench(rows: &[Row], pgbench: &[(usize, f64)]) {
    if pgbench.is_empty() {
        return;
    }
    println!();
    println!("postgres new keys against pgbench -N on the same server, same concurrency:");
    for (c, tps) in pgbench {
        if let Some(row) =
            rows.iter().find(|r| r.target == "idem new keys" && r.store == "postgres" && r.concurrency == *c)
        {
            let rate = row.measured.per_second();
            println!("  c={c:<3} idem {rate:>8.0} req/s   pgbench {tps:>8.0} tps   x pgbench {:.2}", rate / tps);
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter or other flags are not used by this benchmark.
    let settings = Settings {
        measure: seconds_from_env("IDEM_BENCH_SECS", 5.0),
        warmup: seconds_from_env("IDEM_BENCH_WARMUP_SECS", 0.5),
        stores: stores_from_env(),
        rounds: rounds_from_env(),
    };
    // What `idem serve` logs by default to a file, formatted and written as it would be (the
    // batched writer, the access line's own formatter), then thrown away.
    let _flushed = std::env::var("IDEM_BENCH_LOGS").is_ok_and(|v| v == "1").then(|| {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let (writer, flushed) = idem::observe::logs::batched(std::io::sink()).unwrap();
        idem::observe::access_line::install(writer.clone(), idem::observe::access_line::Shape::Text);
        let lines = tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(false);
        let filter = tracing_subscriber::EnvFilter::new("info,sqlx::postgres::notice=warn");
        tracing_subscriber::registry().with(lines).with(filter).init();
        flushed
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(bench(settings));
    runtime.shutdown_timeout(Duration::from_secs(2));
}
