//! The limits of docs/security.md at the edge, through raw sockets: clients that hold connections without
//! finishing their requests are cut, the admin listener answers while the data plane is full,
//! and request bodies held in memory stay within their bound.

use std::time::{Duration, Instant};

use crate::common::{both_stores, send, Backend, Broker, Db, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: &str = r#"{"amount":42,"currency":"eur"}"#;

/// No wait in these tests comes near this unless the limit under test does not hold.
const PATIENCE: Duration = Duration::from_secs(10);

async fn start(b: Backend, server: &str, route_extra: &str) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\n{}",
        crate::common::TestConfig::new(&upstream.url()).store(&db.url).route(route_extra).body()
    );
    let broker = Broker::start_with(&db, text).await;
    (upstream, broker)
}

async fn connect(base: &str) -> TcpStream {
    TcpStream::connect(base.trim_start_matches("http://")).await.unwrap()
}

/// The head of a keyed POST that announces `length` body bytes.
fn head(key: &str, length: usize) -> String {
    format!(
        "POST /payments HTTP/1.1\r\nhost: idem\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    )
}

/// Everything the broker sends until it closes the connection (a reset counts as closing).
/// Fails if the connection is still open after [`PATIENCE`].
async fn until_closed(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let reading = async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    tokio::time::timeout(PATIENCE, reading).await.expect("the broker kept the connection open");
    String::from_utf8_lossy(&received).into_owned()
}

/// Reads one answer whose body is `content-length` long, leaving the connection open.
async fn one_answer(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    let reading = async {
        loop {
            let n = stream.read(&mut buffer).await.unwrap();
            assert!(n > 0, "closed before a whole answer: {:?}", String::from_utf8_lossy(&received));
            received.extend_from_slice(&buffer[..n]);
            let text = String::from_utf8_lossy(&received).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_string))
                    .and_then(|l| l.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if body.len() >= length {
                    return text;
                }
            }
        }
    };
    tokio::time::timeout(PATIENCE, reading).await.expect("no whole answer arrived")
}

/// 1,100 idle sockets against a table of 416 kept it full for the whole header timeout; now a
/// full table of idle sockets (opened, nothing sent) makes room: the longest idle are closed
/// unanswered and a normal client is served at once, long before the header timeout.
async fn a_table_full_of_idle_sockets_makes_room_for_a_normal_client_at_once(b: Backend) {
    let (upstream, broker) = start(b, "max_connections = 20\nheader_timeout = \"60s\"", "").await;
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(connect(&broker.url).await);
    }
    // Accepted in order: these twenty fill the table before the client's connection comes.
    let r = send(broker.post("/payments", "while-full", BODY)).await;
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(upstream.hits("while-full"), 1);
    for socket in &mut idle {
        assert_eq!(until_closed(socket).await, "", "an idle socket is closed unanswered, well before 60 s");
    }
    // The metrics are the process's, shared with the tests running beside this one.
    let metrics = broker.metrics().await;
    let reclaimed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("idem_connections_reclaimed_total{listener=\"data\"} "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(reclaimed >= Some(20), "{metrics}");
    // The admin listener has a table of its own.
    let health = broker.http.get(format!("{}/healthz", broker.admin)).send().await.unwrap();
    assert_eq!(health.status(), 200);
    broker.stop().await;
}

/// A connection busy with a request is never closed to make room: with every one busy, a new
/// connection is answered 503 `overloaded` at once, and nothing of it is recorded.
async fn a_table_full_of_busy_connections_refuses_a_new_one_at_once(b: Backend) {
    let (upstream, broker) = start(b, "max_connections = 4", "").await;
    let gate = crate::common::Gate::closed();
    let mut held = Vec::new();
    for n in 0..4 {
        let key = format!("held-{n}");
        upstream.script(&key, vec![crate::common::Reply::status(201).held_by(&gate)]);
        held.push(tokio::spawn(send(broker.post("/payments", &key, BODY))));
    }
    for n in 0..4 {
        upstream.await_hits(&format!("held-{n}"), 1).await;
    }

    let mut stream = connect(&broker.url).await;
    stream.write_all(format!("{}{BODY}", head("refused", BODY.len())).as_bytes()).await.unwrap();
    let answer = until_closed(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("retry-after: 1") && answer.contains("urn:idem:problem:overloaded"), "{answer}");
    let health = broker.http.get(format!("{}/healthz", broker.admin)).send().await.unwrap();
    assert_eq!(health.status(), 200, "the admin listener stays reachable");

    gate.open();
    for held in held {
        assert_eq!(held.await.unwrap().status, 201, "the busy connections were left to finish");
    }
    assert_eq!(upstream.hits("refused"), 0);
    assert_eq!(broker.record("refused").await.status(), 404);
    broker.stop().await;
}

async fn a_keep_alive_connection_serves_several_requests_and_is_cut_once_idle(b: Backend) {
    let header_timeout = Duration::from_millis(500);
    let (upstream, broker) = start(b, "header_timeout = \"500ms\"", "").await;
    let mut client = connect(&broker.url).await;
    let mut asked = Instant::now();
    for key in ["kept-1", "kept-2"] {
        asked = Instant::now();
        client.write_all(format!("{}{BODY}", head(key, BODY.len())).as_bytes()).await.unwrap();
        let answer = one_answer(&mut client).await;
        assert!(answer.starts_with("HTTP/1.1 201 "), "{answer}");
    }
    assert_eq!(upstream.hits("kept-1") + upstream.hits("kept-2"), 2);
    assert_eq!(until_closed(&mut client).await, "");
    // The broker's idle time runs from the moment its last answer went out, which is after the
    // last request was sent and before this client read it: only the first is a bound here.
    assert!(asked.elapsed() >= header_timeout, "cut {:?} after the last request", asked.elapsed());
    broker.stop().await;
}

async fn a_slowloris_head_is_cut_after_the_header_timeout_while_others_are_served(b: Backend) {
    let header_timeout = Duration::from_millis(500);
    let (_upstream, broker) = start(b, "header_timeout = \"500ms\"", "").await;
    let started = Instant::now();
    let (mut reader, mut writer) = connect(&broker.url).await.into_split();
    let trickle = tokio::spawn(async move {
        let head = b"POST /payments HTTP/1.1\r\nhost: idem\r\nx-padding: ";
        for byte in head.iter().chain(std::iter::repeat(&b'a')) {
            if writer.write_all(&[*byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });

    let r = send(broker.post("/payments", "meanwhile", BODY)).await;
    assert_eq!(r.status, 201, "a normal client is served while the slow one trickles");

    let mut received = Vec::new();
    let closed = tokio::time::timeout(PATIENCE, reader.read_to_end(&mut received)).await;
    assert!(closed.is_ok(), "the slow head was never cut");
    assert!(started.elapsed() >= header_timeout, "cut after {:?}", started.elapsed());
    trickle.await.unwrap();
    broker.stop().await;
}

async fn a_body_shorter_than_its_content_length_gets_408_and_nothing_is_recorded(b: Backend) {
    let body_timeout = Duration::from_millis(500);
    let (upstream, broker) = start(b, "body_timeout = \"500ms\"", "").await;
    let mut liar = connect(&broker.url).await;
    liar.write_all(head("liar", 1000).as_bytes()).await.unwrap();
    let sent = Instant::now();
    liar.write_all(br#"{"amount":"#).await.unwrap();

    let answer = until_closed(&mut liar).await;
    assert!(sent.elapsed() >= body_timeout, "answered after {:?}", sent.elapsed());
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    let lower = answer.to_ascii_lowercase();
    assert!(
        lower.contains("content-type: application/problem+json") && lower.contains("connection: close"),
        "{answer}"
    );
    assert!(answer.contains("urn:idem:problem:request-timeout"), "{answer}");
    assert_eq!(broker.record("liar").await.status(), 404);
    assert_eq!(upstream.hits("liar"), 0);
    broker.stop().await;
}

async fn a_body_trickled_in_forever_is_cut_at_the_route_deadline(b: Backend) {
    let deadline = Duration::from_millis(800);
    let (upstream, broker) = start(b, "body_timeout = \"5s\"", "[routes.retry]\ndeadline = \"800ms\"").await;
    let (mut reader, mut writer) = connect(&broker.url).await.into_split();
    writer.write_all(head("trickled", 1000).as_bytes()).await.unwrap();
    let started = Instant::now();
    // Never silent for long, and never done: 1000 bytes at this pace take 20 s.
    let trickle = tokio::spawn(async move {
        for _ in 0..1000 {
            if writer.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });

    let mut received = Vec::new();
    let closed = tokio::time::timeout(PATIENCE, reader.read_to_end(&mut received)).await;
    assert!(closed.is_ok(), "the trickled body was never cut");
    assert!(started.elapsed() >= deadline, "cut after {:?}", started.elapsed());
    let answer = String::from_utf8_lossy(&received);
    assert!(answer.starts_with("HTTP/1.1 408 ") && answer.contains("request-timeout"), "{answer}");
    trickle.abort();
    assert_eq!(broker.record("trickled").await.status(), 404);
    assert_eq!(upstream.hits("trickled"), 0);
    broker.stop().await;
}

async fn bodies_past_the_memory_bound_get_503_and_nothing_is_recorded(b: Backend) {
    let (upstream, broker) = start(b, "max_buffered_bodies = \"4KiB\"", "max_body = \"2KiB\"").await;
    let full = 2048;
    let mut held = Vec::new();
    for key in ["held-1", "held-2"] {
        let mut upload = connect(&broker.url).await;
        upload.write_all(head(key, full).as_bytes()).await.unwrap();
        upload.write_all(&[b' '; 100]).await.unwrap();
        held.push(upload);
    }
    // Both declared lengths are reserved as soon as their reading starts.
    let until = Instant::now() + PATIENCE;
    while broker.buffered_body_bytes().await != 2 * full as u64 {
        assert!(Instant::now() < until, "the held uploads were never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let r = send(broker.post("/payments", "one-too-many", BODY)).await;
    r.assert_problem(503, "overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("idempotency-status"), Some("not_started"));
    assert_eq!(broker.record("one-too-many").await.status(), 404);
    assert_eq!(upstream.hits("one-too-many"), 0);

    for upload in &mut held {
        upload.write_all(&[b' '; 2048 - 100]).await.unwrap();
        let answer = one_answer(upload).await;
        assert!(answer.starts_with("HTTP/1.1 201 "), "{answer}");
    }
    assert_eq!(broker.buffered_body_bytes().await, 0, "answered bodies are given back");
    let r = send(broker.post("/payments", "one-too-many", BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(upstream.hits("held-1") + upstream.hits("held-2") + upstream.hits("one-too-many"), 3);
    broker.stop().await;
}

/// A client that sends its whole body before reading the answer (most do) hears the 413: the
/// broker reads what follows its refusal and throws it away, rather than closing with bytes
/// unread, which the kernel answers with a reset that the client sees instead. Pinned without a
/// race: the answer is read first, and the body sent after it must still be taken, with the
/// connection open for the next request.
async fn a_body_refused_as_too_large_is_read_and_thrown_away_so_its_client_hears_413(b: Backend) {
    let (upstream, broker) = start(b, "", "max_body = \"1KiB\"").await;
    let mut client = connect(&broker.url).await;
    let length = 64 * 1024;
    client.write_all(head("too-big", length).as_bytes()).await.unwrap();
    let refused = one_answer(&mut client).await;
    assert!(refused.starts_with("HTTP/1.1 413 "), "{refused}");
    client.write_all(&vec![b'x'; length]).await.unwrap();
    client.write_all(format!("{}{BODY}", head("after-it", BODY.len())).as_bytes()).await.unwrap();
    let next = one_answer(&mut client).await;
    assert!(next.starts_with("HTTP/1.1 201 "), "{next}");
    assert_eq!((upstream.hits("too-big"), upstream.hits("after-it")), (0, 1));
    broker.stop().await;
}

both_stores!(
    a_body_refused_as_too_large_is_read_and_thrown_away_so_its_client_hears_413,
    a_keep_alive_connection_serves_several_requests_and_is_cut_once_idle,
    a_table_full_of_idle_sockets_makes_room_for_a_normal_client_at_once,
    a_table_full_of_busy_connections_refuses_a_new_one_at_once,
    a_slowloris_head_is_cut_after_the_header_timeout_while_others_are_served,
    a_body_shorter_than_its_content_length_gets_408_and_nothing_is_recorded,
    a_body_trickled_in_forever_is_cut_at_the_route_deadline,
    bodies_past_the_memory_bound_get_503_and_nothing_is_recorded,
);
