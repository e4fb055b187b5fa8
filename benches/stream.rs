//! Streaming benchmark (SPEC §11): what passing a streamed answer through Idem adds to its time
//! to first byte, and what streams in flight cost in memory.
//!
//! Everything runs in this process on 127.0.0.1: an upstream that answers server-sent events
//! (`data: {…}` lines, the first at once, then one every gap, ending with `data: [DONE]`), and
//! Idem (SQLite, `synchronous=FULL`) in front of it.
//!
//! 1. Time to first byte: requests one after another, straight to the upstream (the plain path)
//!    and through Idem with a new key each, taking turns. The time runs from the send to the
//!    first body byte; printed are p50 and p99 of each and what Idem adds.
//! 2. Memory: `IDEM_STREAM_CONCURRENT` (default 1,000) streams opened at once, each event a second
//!    apart, first straight to the upstream, then through Idem. This process's resident memory
//!    is read before and once every stream has its first byte; the straight run's growth per
//!    stream (the clients' and the upstream's share) is taken from Idem's, which leaves what Idem
//!    holds per stream in flight.
//!
//! `IDEM_STREAM_SAMPLES` (default 500) sets the first part's requests per path. Run with
//! `cargo bench --bench stream`.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::response::Response;
use hdrhistogram::Histogram;
use idem::config::Config;
use tokio::net::TcpListener;

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
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn idem_config(store_url: &str, upstream: &str, concurrent: usize) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

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

/// This process's resident memory, in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Opens `n` streams to `url` at once and returns the resident memory growth, in KiB, once every
/// one has its first byte; the streams then run to their end.
async fn memory_of_streams(http: &reqwest::Client, url: &str, n: usize, keyed: bool, run: &str) -> i64 {
    let before = resident_kib();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(n);
    // A watch, not a Notify: a task that has not begun to wait when the release comes still sees it.
    let (release, released) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (http, url, ready_tx, mut released) = (http.clone(), url.to_string(), ready_tx.clone(), released.clone());
        let key = format!("{run}-{i}");
        tasks.push(tokio::spawn(async move {
            let (_, response) = first_byte(&http, &url, keyed.then_some(key.as_str())).await;
            let _ = ready_tx.send(()).await;
            let _ = released.wait_for(|go| *go).await;
            drain(response).await;
        }));
    }
    for started in 0..n {
        match tokio::time::timeout(Duration::from_secs(30), ready_rx.recv()).await {
            Ok(Some(())) => {}
            _ => panic!("{run}: only {started} of {n} streams had their first byte within 30 s"),
        }
    }
    let during = resident_kib();
    let _ = release.send(true);
    for task in tasks {
        task.await.expect("a stream task");
    }
    during as i64 - before as i64
}

fn main() {
    let samples: usize = std::env::var("IDEM_STREAM_SAMPLES").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let concurrent: usize = std::env::var("IDEM_STREAM_CONCURRENT").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async move {
        let upstream = start_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite://{}", dir.path().join("idem.db").display());
        let config = Config::parse_with_env(&idem_config(&store, &upstream, concurrent), |_| None).unwrap();
        let running = idem::server::start(config).await.expect("idem starts");
        let through_idem = format!("http://{}/v1/chat/completions", running.listen);
        let straight = format!("{upstream}/v1/chat/completions");
        println!("idem streaming benchmark: upstream {upstream}, idem on {}", running.listen);

        // 1. Time to first byte, the two paths taking turns; the rest of each stream is quick.
        let http = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(4).build().unwrap();
        let quick = "?events=3&gap_ms=1";
        let (mut plain, mut idem) = (Histogram::<u64>::new(3).unwrap(), Histogram::<u64>::new(3).unwrap());
        for i in 0..samples + 50 {
            let (t, response) = first_byte(&http, &format!("{straight}{quick}"), None).await;
            drain(response).await;
            let (u, response) = first_byte(&http, &format!("{through_idem}{quick}"), Some(&format!("ttfb-{i}"))).await;
            drain(response).await;
            // The first 50 of each warm the connections and the store.
            if i >= 50 {
                plain.record(t.as_micros() as u64).unwrap();
                idem.record(u.as_micros() as u64).unwrap();
            }
        }
        println!("\ntime to first byte, {samples} requests per path, one at a time (microseconds):");
        println!("{:<28} {:>8} {:>8}", "path", "p50", "p99");
        println!("{:<28} {:>8} {:>8}", "straight to the upstream", micros(&plain, 0.5), micros(&plain, 0.99));
        println!("{:<28} {:>8} {:>8}", "through idem, new keys", micros(&idem, 0.5), micros(&idem, 0.99));
        let added = micros(&idem, 0.5) as i64 - micros(&plain, 0.5) as i64;
        println!("idem adds {added} us at p50 (the target: within 1000 us)");

        // 2. Memory of streams in flight.
        let slow = "?events=5&gap_ms=1000";
        let many = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(concurrent).build().unwrap();
        let straight_kib = memory_of_streams(&many, &format!("{straight}{slow}"), concurrent, false, "plain").await;
        let idem_kib = memory_of_streams(&many, &format!("{through_idem}{slow}"), concurrent, true, "mem").await;
        let per = |kib: i64| kib as f64 / concurrent as f64;
        println!("\n{concurrent} streams in flight at once (resident memory of this process, KiB):");
        println!(
            "  straight to the upstream: +{straight_kib} ({:.1} per stream: clients and upstream)",
            per(straight_kib)
        );
        println!("  through idem:             +{idem_kib} ({:.1} per stream)", per(idem_kib));
        println!("  idem's own share:          {:.1} KiB per stream in flight", per(idem_kib - straight_kib));
        running.shutdown().await;
    });
}
