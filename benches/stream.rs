//! Streaming benchmark (docs/concepts.md): what passing a streamed answer through Idem adds to its time
//! to first byte, and what streams in flight cost in memory.
//!
//! Idem runs as operators run it: the `idem` binary in a process of its own, on its default
//! configuration (SQLite, `synchronous=FULL`, info logging to a file). This process holds the
//! clients and an upstream that answers server-sent events (`data: {…}` lines, the first at
//! once, then one every gap, ending with `data: [DONE]`), all on 127.0.0.1.
//!
//! 1. Time to first byte: requests one after another, straight to the upstream, through nginx
//!    (the plain proxy, `proxy_buffering off`, when `nginx` is on the PATH) and through Idem with
//!    a new key each, taking turns. The time runs from the send to the first body byte; printed
//!    are p50 and p99 of each and what Idem adds to the plain proxy's (to the straight path's
//!    without nginx). Idem's store is warmed first, as on a broker that has run a while: its log
//!    has reached the size at which SQLite writes it over from its start.
//! 2. Memory: `IDEM_STREAM_CONCURRENT` (default 1,000) streams through Idem opened at once, each
//!    event a second apart. Idem's resident memory is read before and once every stream has its
//!    first byte; the growth per stream is what Idem holds per stream in flight.
//!
//! `IDEM_STREAM_SAMPLES` (default 500) sets the first part's requests per path,
//! `IDEM_STREAM_WARMUP` (default 2,000) the requests that warm the store, and `IDEM_STREAM_BIN`
//! another build of `idem` to measure instead of this one. Run with `cargo bench --bench stream`.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::response::Response;
use axum::serve::ListenerExt;
use hdrhistogram::Histogram;
use tokio::net::TcpListener;

#[path = "support/nginx.rs"]
mod nginx;

/// How the upstream streams one answer: `events` events, `gap_ms` apart after the first.
#[derive(serde::Deserialize, Clone, Copy)]
struct Shape {
    events: u32,
    gap_ms: u64,
}

fn event(n: u32) -> Bytes {
    Bytes::from(format!(
        "data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"delta\":{{\"content\":\"part {n} of the answer\"}}}}]}}\n\n"
    ))
}

async fn stream(Query(shape): Query<Shape>) -> Response {
    let parts = futures_util::stream::unfold(0u32, move |n| async move {
        if n > shape.events {
            return None;
        }
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(shape.gap_ms)).await;
        }
        let part = if n == shape.events { Bytes::from_static(b"data: [DONE]\n\n") } else { event(n + 1) };
        Some((Ok::<_, std::io::Error>(part), n + 1))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(parts))
        .unwrap()
}

async fn start_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(stream);
    // Each event goes out as it is written, as streaming upstreams do.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn idem_config(listen: u16, admin: u16, store_url: &str, upstream: &str, concurrent: usize) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{listen}"
admin_listen = "127.0.0.1:{admin}"

[store]
url = "{store_url}"

[[routes]]
name = "chat"
path_prefix = "/v1"
upstream = "{upstream}"
methods = ["POST"]
max_concurrency = {slots}

[worker]
concurrency = {slots}
"#,
        slots = concurrent + 64
    )
}

/// Sends one request and returns the time to its first body byte; the rest of the body is read
/// (and dropped) in the background, or not at all when `keep` is false.
async fn first_byte(http: &reqwest::Client, url: &str, key: Option<&str>) -> (Duration, reqwest::Response) {
    let mut request = http.post(url).header("content-type", "application/json").body(r#"{"model":"m"}"#);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let started = Instant::now();
    let mut response = request.send().await.expect("the request is answered");
    assert!(response.status().is_success(), "status {}", response.status());
    let part = response.chunk().await.expect("the body starts").expect("a first part");
    assert!(!part.is_empty());
    (started.elapsed(), response)
}

async fn drain(mut response: reqwest::Response) {
    while let Ok(Some(_)) = response.chunk().await {}
}

fn micros(h: &Histogram<u64>, q: f64) -> u64 {
    h.value_at_quantile(q)
}

/// The idem process, stopped when dropped.
struct Idem {
    child: std::process::Child,
    url: String,
}

impl Drop for Idem {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ports on 127.0.0.1 that were free a moment ago, all different: bound together, then released
/// (one released at once may well be the next one handed out).
fn free_ports<const N: usize>() -> [u16; N] {
    let held: [std::net::TcpListener; N] = std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    held.map(|l| l.local_addr().unwrap().port())
}

/// Starts `idem serve` in `dir` in front of `upstream`, logging to a file there, and returns
/// once it is ready.
async fn start_idem(dir: &std::path::Path, upstream: &str, concurrent: usize) -> Idem {
    let bin = std::env::var("IDEM_STREAM_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_idem").to_string());
    let [listen, admin] = free_ports();
    let store = format!("sqlite://{}", dir.join("idem.db").display());
    let config = dir.join("idem.toml");
    std::fs::write(&config, idem_config(listen, admin, &store, upstream, concurrent)).unwrap();
    let log = std::fs::File::create(dir.join("idem.log")).unwrap();
    let child = std::process::Command::new(&bin)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
    let idem = Idem { child, url: format!("http://127.0.0.1:{listen}") };
    let probe = reqwest::Client::builder().no_proxy().build().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while !probe.get(format!("http://127.0.0.1:{admin}/readyz")).send().await.is_ok_and(|r| r.status() == 200) {
        assert!(Instant::now() < until, "idem was not ready within 30 s");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    idem
}

/// A process's resident memory, in KiB.
fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Opens `n` streams to `url` at once and returns the growth of `pid`'s resident memory, in KiB,
/// once every one has its first byte; the streams then run to their end.
async fn memory_of_streams(http: &reqwest::Client, url: &str, n: usize, pid: u32) -> i64 {
    let before = resident_kib(pid);
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(n);
    // A watch, not a Notify: a task that has not begun to wait when the release comes still sees it.
    let (release, released) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (http, url, ready_tx, mut released) = (http.clone(), url.to_string(), ready_tx.clone(), released.clone());
        let key = format!("memory-{i}");
        tasks.push(tokio::spawn(async move {
            let (_, response) = first_byte(&http, &url, Some(&key)).await;
            let _ = ready_tx.send(()).await;
            let _ = released.wait_for(|go| *go).await;
            drain(response).await;
        }));
    }
    for started in 0..n {
        match tokio::time::timeout(Duration::from_secs(30), ready_rx.recv()).await {
            Ok(Some(())) => {}
            _ => panic!("only {started} of {n} streams had their first byte within 30 s"),
        }
    }
    let during = resident_kib(pid);
    let _ = release.send(true);
    for task in tasks {
        task.await.expect("a stream task");
    }
    during as i64 - before as i64
}

fn main() {
    let samples: usize = std::env::var("IDEM_STREAM_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let warmup: usize = std::env::var("IDEM_STREAM_WARMUP").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let concurrent: usize = std::env::var("IDEM_STREAM_CONCURRENT").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let upstream = start_upstream().await;
        // SQLite files live under the target directory (a real disk), not a possibly in-memory /tmp.
        let dir = tempfile::Builder::new().prefix("idem-stream-").tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let idem = start_idem(dir.path(), &upstream, concurrent).await;
        let through_idem = format!("{}/v1/chat/completions", idem.url);
        let straight = format!("{upstream}/v1/chat/completions");
        println!(
            "idem streaming benchmark: upstream {upstream}, idem on {} (files under {})",
            idem.url,
            dir.path().display()
        );

        // 1. Time to first byte, the paths taking turns; the rest of each stream is quick.
        let http = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(4).build().unwrap();
        let quick = "?events=3&gap_ms=1";
        let proxy = match nginx::start(&upstream, nginx::Buffering::Off).await {
            Ok(proxy) => Some(proxy),
            Err(e) => {
                println!("no plain proxy row: {e}");
                None
            }
        };
        let mut paths = vec![("straight to the upstream", format!("{straight}{quick}"), false)];
        if let Some(proxy) = &proxy {
            paths.push(("through nginx", format!("{}/v1/chat/completions{quick}", proxy.url), false));
        }
        paths.push(("through idem, new keys", format!("{through_idem}{quick}"), true));
        for i in 0..warmup {
            let (_, response) = first_byte(&http, &paths.last().unwrap().1, Some(&format!("warm-{i}"))).await;
            drain(response).await;
        }
        let mut times: Vec<Histogram<u64>> = paths.iter().map(|_| Histogram::new(3).unwrap()).collect();
        for i in 0..samples + 50 {
            for ((_, url, keyed), times) in paths.iter().zip(&mut times) {
                let key = format!("ttfb-{i}");
                let (t, response) = first_byte(&http, url, keyed.then_some(key.as_str())).await;
                drain(response).await;
                // The first 50 of each warm the connections.
                if i >= 50 {
                    times.record(t.as_micros() as u64).unwrap();
                }
            }
        }
        println!("\ntime to first byte, {samples} requests per path, one at a time (microseconds):");
        println!("{:<28} {:>8} {:>8}", "path", "p50", "p99");
        for ((name, ..), times) in paths.iter().zip(&times) {
            println!("{name:<28} {:>8} {:>8}", micros(times, 0.5), micros(times, 0.99));
        }
        let (through, plain) = (&times[times.len() - 1], &times[times.len() - 2]);
        let added = micros(through, 0.5) as i64 - micros(plain, 0.5) as i64;
        let over = if proxy.is_some() { "the plain proxy's" } else { "the straight path's" };
        println!("idem adds {added} us at p50 to {over} (the target: within 1000 us)");
        drop(proxy);

        // 2. Memory of streams in flight.
        let slow = "?events=5&gap_ms=1000";
        let many = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(concurrent).build().unwrap();
        let grown = memory_of_streams(&many, &format!("{through_idem}{slow}"), concurrent, idem.child.id()).await;
        println!("\n{concurrent} streams through idem in flight at once (idem's resident memory):");
        println!("  +{grown} KiB, {:.1} KiB per stream in flight", grown as f64 / concurrent as f64);
    });
}
