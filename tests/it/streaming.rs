//! Streamed answers (docs/concepts.md), through real HTTP: a broker on port 0 in front of an upstream that streams
//! OpenAI-style server-sent events (`data: {…}` lines ending with `data: [DONE]`).

use std::time::Duration;

use crate::common::sse::{event_bytes, events, Answer, SseUpstream, Step, DONE};
use crate::common::{both_stores, send, Backend, Broker, Db, TestConfig};

const BODY: &str = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
const PATH: &str = "/payments/v1/chat/completions";
/// Retries come quickly, so a test that waits for one does not wait long.
const FAST_RETRY: &str = "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n";
const SETTLES: Duration = Duration::from_secs(10);

async fn setup(b: Backend, route_extra: &str, extra: &str) -> (SseUpstream, Broker) {
    let upstream = SseUpstream::start().await;
    let broker =
        Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).route(route_extra).tables(extra)).await;
    (upstream, broker)
}

/// The body of `n` events `part 1` … `part n` and `[DONE]`, as the upstream sends it.
fn whole(n: usize) -> String {
    let mut body: String = (1..=n).map(|i| event_bytes(&format!("part {i}"))).collect();
    body.push_str(DONE);
    body
}

/// Reads `response` until what arrived ends with `until`, and returns all of it.
async fn read_until(response: &mut reqwest::Response, until: &str) -> String {
    let mut seen = Vec::new();
    while !seen.ends_with(until.as_bytes()) {
        let part = response.chunk().await.unwrap().unwrap_or_else(|| panic!("ended before {until:?}: {seen:?}"));
        seen.extend_from_slice(&part);
    }
    String::from_utf8(seen).unwrap()
}

/// Reads the rest of `response`, and whether it ended cleanly.
async fn read_rest(response: &mut reqwest::Response) -> (String, bool) {
    let mut seen = Vec::new();
    let clean = loop {
        match response.chunk().await {
            Ok(Some(part)) => seen.extend_from_slice(&part),
            Ok(None) => break true,
            Err(_) => break false,
        }
    };
    (String::from_utf8(seen).unwrap(), clean)
}

async fn the_first_event_reaches_the_client_before_the_upstream_has_finished(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    upstream.script(
        "first",
        vec![Answer::Stream(vec![Step::Event("part 1".into()), Step::Gate, Step::Event("part 2".into()), Step::Done])],
    );
    let mut response = broker.post(PATH, "first", BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert_eq!(response.headers()["idempotency-status"], "in_progress");
    let first = read_until(&mut response, &event_bytes("part 1")).await;
    assert_eq!(first, event_bytes("part 1"));
    assert_eq!(upstream.finished("first"), 0, "the upstream is held at its gate");
    upstream.open("first");
    let (rest, clean) = read_rest(&mut response).await;
    assert!(clean);
    assert_eq!(format!("{first}{rest}"), whole(2));

    let record = broker.await_record("first", SETTLES, |r| r["state"] == "done").await;
    assert_eq!(record["response"]["status"], 200);
    assert_eq!(record["response"]["body"], whole(2), "the whole body is stored");
    assert_eq!(record["stop_reason"], "success");
    let stream = &record["stream"];
    assert_eq!(stream["bytes"], whole(2).len(), "{record:#}");
    assert_eq!(stream["stored"], true);
    assert!(stream.get("cut_at").is_none(), "a whole stream has no cut");
    assert!(stream["first_byte_ms"].as_u64().unwrap() <= stream["duration_ms"].as_u64().unwrap());
    assert_eq!(upstream.hits("first"), 1);

    let metrics = broker.metrics().await;
    for name in
        ["idem_stream_first_byte_seconds_count", "idem_stream_duration_seconds_count", "idem_stream_bytes_total"]
    {
        assert!(metrics.contains(&format!("{name}{{route=\"payments\"}}")), "{name} missing from:\n{metrics}");
    }
}

async fn a_503_before_the_first_byte_is_retried(b: Backend) {
    let (upstream, broker) = setup(b, "", FAST_RETRY).await;
    upstream.script("busy", vec![Answer::Refuse(503), Answer::Stream(events(2))]);
    let r = send(broker.post(PATH, "busy", BODY)).await;
    assert_eq!(r.status, 200);
    assert_eq!(std::str::from_utf8(&r.body).unwrap(), whole(2));
    assert_eq!(upstream.hits("busy"), 2);
    let record = broker.await_record("busy", SETTLES, |r| r["state"] == "done").await;
    let outcomes: Vec<_> = record["attempts"].as_array().unwrap().iter().map(|a| a["outcome"].clone()).collect();
    assert_eq!(outcomes, ["not_executed", "success"]);
}

async fn a_client_that_disconnects_still_leaves_a_replayable_record(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    upstream.script(
        "leaves",
        vec![Answer::Stream(vec![Step::Event("part 1".into()), Step::Gate, Step::Event("part 2".into()), Step::Done])],
    );
    let mut response = broker.post(PATH, "leaves", BODY).send().await.unwrap();
    read_until(&mut response, &event_bytes("part 1")).await;
    drop(response);
    upstream.open("leaves");
    broker.await_record("leaves", SETTLES, |r| r["state"] == "done").await;

    let again = send(broker.post(PATH, "leaves", BODY)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(std::str::from_utf8(&again.body).unwrap(), whole(2), "read to its end without the client");
    assert_eq!(upstream.hits("leaves"), 1, "never a second execution");
}

async fn a_duplicate_of_a_done_stream_gets_the_same_bytes_status_and_headers(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    upstream.script("again", vec![Answer::Stream(events(3))]);
    let first = send(broker.post(PATH, "again", BODY)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("idempotent-replayed"), None);
    broker.await_record("again", SETTLES, |r| r["state"] == "done").await;

    let replay = send(broker.post(PATH, "again", BODY)).await;
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body, "byte for byte");
    assert_eq!(replay.header("content-type"), Some("text/event-stream"));
    assert_eq!(replay.header("cache-control"), Some("no-cache"));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("idempotency-status"), Some("done"));
    assert_eq!(upstream.hits("again"), 1);
}

/// The problem in the `idem-error` event that ends a cut event stream, and what came before it.
fn error_event(seen: &str) -> (String, serde_json::Value) {
    let at = seen.find("event: idem-error\n").unwrap_or_else(|| panic!("no idem-error event in {seen:?}"));
    let data: String = seen[at..].lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    (seen[..at].to_string(), serde_json::from_str(&data).unwrap())
}

/// Three events, then the upstream cuts the connection.
fn cut_after_three() -> Vec<Step> {
    vec![Step::Event("part 1".into()), Step::Event("part 2".into()), Step::Event("part 3".into()), Step::Cut]
}

async fn a_cut_after_the_third_event_is_unknown_keeps_the_partial_body_and_is_never_sent_again(b: Backend) {
    let (upstream, broker) = setup(b, "", FAST_RETRY).await;
    upstream.script("cut", vec![Answer::Stream(cut_after_three())]);
    let mut response = broker.post(PATH, "cut", BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let (seen, clean) = read_rest(&mut response).await;
    assert!(!clean, "the client's stream ends with an error, not as though whole");
    let (before, problem) = error_event(&seen);
    let three: String = (1..=3).map(|i| event_bytes(&format!("part {i}"))).collect();
    assert_eq!(before, three);
    assert_eq!(problem["type"], "urn:idem:problem:stream-cut");
    assert_eq!(problem["idempotency_key"], "cut");

    let record = broker.await_record("cut", SETTLES, |r| r["state"] == "unknown").await;
    assert_eq!(record["stop_reason"], "stream_cut");
    assert_eq!(record["response"]["body"], three, "the partial body is kept for the operator");
    assert_eq!(record["stream"]["cut_at"], three.len(), "where it was cut");
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0]["status"], 200);

    let again = send(broker.post(PATH, "cut", BODY)).await;
    again.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.hits("cut"), 1, "never re-sent");
}

async fn a_cut_on_a_replay_safe_route_frees_the_key(b: Backend) {
    let (upstream, broker) = setup(b, "replay_safe = true", FAST_RETRY).await;
    upstream.script("safe", vec![Answer::Stream(cut_after_three())]);
    let mut response = broker.post(PATH, "safe", BODY).send().await.unwrap();
    let (seen, clean) = read_rest(&mut response).await;
    assert!(!clean);
    let (_, problem) = error_event(&seen);
    assert_eq!(problem["type"], "urn:idem:problem:stream-cut");
    let record = broker.await_record("safe", SETTLES, |r| r["state"] == "not_started").await;
    assert_eq!(record["stop_reason"], "stream_cut");
    assert!(record["response"].is_null(), "nothing is kept for a freed key");
    assert_eq!(upstream.hits("safe"), 1, "not retried within the answer");

    let afresh = send(broker.post(PATH, "safe", BODY)).await;
    assert_eq!(afresh.status, 200);
    assert_eq!(std::str::from_utf8(&afresh.body).unwrap(), whole(3));
    assert_eq!(upstream.hits("safe"), 2, "the freed key executes afresh");
}

async fn a_cut_in_a_chunked_answer_aborts_the_clients_response_and_is_unknown(b: Backend) {
    let (upstream, broker) = setup(b, "", FAST_RETRY).await;
    upstream.script("chunked", vec![Answer::Chunked(cut_after_three())]);
    let mut response = broker.post(PATH, "chunked", BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let (seen, clean) = read_rest(&mut response).await;
    assert!(!clean, "the response is aborted (no last chunk), not ended as though whole");
    let three: String = (1..=3).map(|i| event_bytes(&format!("part {i}"))).collect();
    assert_eq!(seen, three, "what arrived before the cut, and no event added to a body that is not an event stream");

    let record = broker.await_record("chunked", SETTLES, |r| r["state"] == "unknown").await;
    assert_eq!(record["stop_reason"], "stream_cut");
    assert_eq!(record["response"]["body"], three, "the partial body is kept for the operator");
    assert_eq!(record["stream"]["cut_at"], three.len());
    send(broker.post(PATH, "chunked", BODY)).await.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.hits("chunked"), 1, "never re-sent");
}

async fn a_client_that_stops_reading_holds_the_upstream_no_longer_than_the_deadline(b: Backend) {
    // Past max_stored_body the upstream is read only a window ahead of the client: a client
    // that stops reading holds the upstream back, until the deadline ends the stream.
    let limits = "max_stored_body = \"1KiB\"\n[routes.retry]\ndeadline = \"2s\"\n";
    let (upstream, broker) = setup(b, limits, "").await;
    // 50 MiB: more than the sockets between the upstream, the broker and the client can hold.
    let mut long: Vec<Step> = (0..800).map(|_| Step::Filler(64 * 1024)).collect();
    long.push(Step::Done);
    upstream.script("stuck", vec![Answer::Stream(long)]);
    let mut response = broker.post(PATH, "stuck", BODY).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.chunk().await.unwrap().is_some(), "the stream starts");
    // The client reads nothing more, and keeps its connection open.
    let record = broker.await_record("stuck", SETTLES, |r| r["state"] == "unknown").await;
    assert_eq!(record["stop_reason"], "deadline", "{record:#}");
    assert_eq!(record["stream"]["stored"], false);
    assert_eq!(upstream.finished("stuck"), 0, "the upstream was never read to its end");
    assert_eq!(upstream.hits("stuck"), 1);
    drop(response);
}

async fn a_stall_past_the_idle_timeout_ends_the_stream_as_unknown(b: Backend) {
    let retry = "[routes.retry]\nstream_idle_timeout = \"200ms\"\n";
    let (upstream, broker) = setup(b, "", retry).await;
    upstream.script("stall", vec![Answer::Stream(vec![Step::Event("part 1".into()), Step::Stall])]);
    let mut response = broker.post(PATH, "stall", BODY).send().await.unwrap();
    let (seen, clean) = read_rest(&mut response).await;
    assert!(!clean);
    let (before, problem) = error_event(&seen);
    assert_eq!(before, event_bytes("part 1"));
    assert!(problem["detail"].as_str().unwrap().contains("stream_idle_timeout"), "{problem}");
    let record = broker.await_record("stall", SETTLES, |r| r["state"] == "unknown").await;
    assert_eq!(record["stop_reason"], "stream_idle_timeout");
    assert_eq!(record["attempts"][0]["error"], "stream_idle_timeout");
    assert_eq!(upstream.hits("stall"), 1);
}

async fn a_duplicate_that_waits_during_the_stream_attaches_and_gets_the_same_bytes(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let gated = vec![Step::Event("part 1".into()), Step::Gate, Step::Event("part 2".into()), Step::Done];
    upstream.script("attach", vec![Answer::Stream(gated)]);
    let mut first = broker.post(PATH, "attach", BODY).send().await.unwrap();
    let head = read_until(&mut first, &event_bytes("part 1")).await;

    // Without waiting, a duplicate is refused while the stream runs.
    let refused = send(broker.post(PATH, "attach", BODY)).await;
    refused.assert_problem(409, "request-in-progress");

    let mut second = broker.post(PATH, "attach", BODY).header("prefer", "wait=10").send().await.unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["content-type"], "text/event-stream");
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    let already = read_until(&mut second, &event_bytes("part 1")).await;
    assert_eq!(already, head, "what was already sent, from the first byte");
    assert_eq!(upstream.finished("attach"), 0, "the upstream is still held: the duplicate follows live");

    upstream.open("attach");
    let (rest1, clean1) = read_rest(&mut first).await;
    let (rest2, clean2) = read_rest(&mut second).await;
    assert!(clean1 && clean2);
    assert_eq!(format!("{head}{rest1}"), whole(2));
    assert_eq!(format!("{already}{rest2}"), whole(2));
    assert_eq!(upstream.hits("attach"), 1, "never a second execution");
}

async fn a_duplicate_waiting_before_the_stream_starts_attaches_when_it_does(b: Backend) {
    // A route of this test's own: the metrics are the process's, and no other test waits on it.
    let route = format!("early-{b:?}");
    let upstream = SseUpstream::start().await;
    let db = Db::new(b).await;
    let config =
        TestConfig::new(&upstream.url()).store(&db.url).text().replace("\"payments\"", &format!("\"{route}\""));
    let broker = Broker::start_with(&db, config).await;
    upstream
        .script("early", vec![Answer::Stream(vec![Step::Gate, Step::Event("part 1".into()), Step::Gate, Step::Done])]);
    let first = tokio::spawn(broker.post(PATH, "early", BODY).send());
    broker.await_record("early", SETTLES, |r| r["state"] == "in_progress").await;
    let second = tokio::spawn(broker.post(PATH, "early", BODY).header("prefer", "wait=10").send());
    // The duplicate is waiting before the upstream sends its first byte.
    let waiting = |n: u32| format!("idem_waiting_requests{{route=\"{route}\"}} {n}");
    broker.await_metric(&waiting(1)).await;
    assert_eq!(upstream.finished("early"), 0);
    upstream.open("early");
    let mut second = second.await.unwrap().unwrap();
    assert_eq!(second.status(), 200);
    let part = read_until(&mut second, &event_bytes("part 1")).await;
    assert_eq!(part, event_bytes("part 1"));
    upstream.open("early");
    let (rest, clean) = read_rest(&mut second).await;
    assert!(clean);
    assert_eq!(format!("{part}{rest}"), whole(1));
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.bytes().await.unwrap(), whole(1).as_bytes());
    assert_eq!(upstream.hits("early"), 1);
    broker.await_metric(&waiting(0)).await;
}

/// A duplicate that waits finds the answer streaming but cannot join it: past `max_stored_body`
/// the stream no longer holds its beginning. It waits for the record to settle, and is told
/// what became of it, instead of hearing at once that the request is still in progress.
async fn a_duplicate_that_cannot_join_a_stream_waits_for_its_record_instead(b: Backend) {
    // A route of this test's own: the metrics are the process's, and no other test waits on it.
    let route = format!("unjoinable-{b:?}");
    let upstream = SseUpstream::start().await;
    let db = Db::new(b).await;
    let config = TestConfig::new(&upstream.url())
        .route("max_stored_body = \"200B\"")
        .store(&db.url)
        .text()
        .replace("\"payments\"", &format!("\"{route}\""));
    let broker = Broker::start_with(&db, config).await;
    let mut steps: Vec<Step> = (1..=5).map(|i| Step::Event(format!("part {i}"))).collect();
    steps.extend([Step::Gate, Step::Done]);
    upstream.script("unjoinable", vec![Answer::Stream(steps)]);
    let mut first = broker.post(PATH, "unjoinable", BODY).send().await.unwrap();
    let head = read_until(&mut first, &event_bytes("part 5")).await;
    assert!(head.len() > 200, "the stream is past what is kept");

    let second = tokio::spawn(send(broker.post(PATH, "unjoinable", BODY).header("prefer", "wait=10")));
    let waiting = |n: u32| format!("idem_waiting_requests{{route=\"{route}\"}} {n}");
    broker.await_metric(&waiting(1)).await;
    assert!(!second.is_finished(), "it waits for the record, not for a stream it cannot join");
    upstream.open("unjoinable");
    let (_, clean) = read_rest(&mut first).await;
    assert!(clean);
    let waited = second.await.unwrap();
    waited.assert_problem(409, "response-not-stored");
    assert_eq!(waited.header("idempotency-status"), Some("done"));
    assert_eq!(upstream.hits("unjoinable"), 1, "never a second execution");
}

async fn an_answer_longer_than_max_stored_body_streams_through_but_is_never_replayed_nor_sent_again(b: Backend) {
    let (upstream, broker) = setup(b, "max_stored_body = \"200B\"", "").await;
    upstream.script("long", vec![Answer::Stream(events(5))]);
    let first = send(broker.post(PATH, "long", BODY)).await;
    assert_eq!(first.status, 200);
    assert_eq!(std::str::from_utf8(&first.body).unwrap(), whole(5), "the client gets it all");
    assert!(whole(5).len() > 200);

    let record = broker.await_record("long", SETTLES, |r| r["state"] == "done").await;
    assert_eq!(record["stream"]["stored"], false, "{record:#}");
    assert_eq!(record["stream"]["bytes"], whole(5).len());
    let again = send(broker.post(PATH, "long", BODY)).await;
    again.assert_problem(409, "response-not-stored");
    assert_eq!(again.header("idempotency-status"), Some("done"));
    let waited = send(broker.post(PATH, "long", BODY).header("prefer", "wait=5")).await;
    waited.assert_problem(409, "response-not-stored");
    assert_eq!(upstream.hits("long"), 1, "never a second execution");
}

async fn a_cut_answer_too_long_to_keep_replays_the_operators_resolution(b: Backend) {
    let (upstream, broker) = setup(b, "max_stored_body = \"200B\"", "").await;
    let long_then_cut = vec![Step::Filler(300), Step::Cut];
    upstream.script("long-cut", vec![Answer::Stream(long_then_cut)]);
    let mut response = broker.post(PATH, "long-cut", BODY).send().await.unwrap();
    assert!(!read_rest(&mut response).await.1, "the client's stream ends with an error");
    let record = broker.await_record("long-cut", SETTLES, |r| r["state"] == "unknown").await;
    assert_eq!(record["stream"]["stored"], false, "{record:#}");

    // The operator knows the call executed, and gives the answer to replay from now on.
    let id = record["id"].as_str().unwrap();
    let resolution = serde_json::json!({"outcome": "executed", "response": {"status": 200, "body": "settled"}});
    let resolved =
        send(broker.http.post(format!("{}/admin/requests/{id}/resolve", broker.admin)).json(&resolution)).await;
    assert_eq!(resolved.status, 200, "{}", String::from_utf8_lossy(&resolved.body));
    let replayed = send(broker.post(PATH, "long-cut", BODY)).await;
    assert_eq!(replayed.status, 200, "{}", String::from_utf8_lossy(&replayed.body));
    assert_eq!(&replayed.body[..], b"settled");
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("long-cut"), 1, "never sent again");
}

/// A client on a kept-alive connection (as SDKs keep them) gets each event as the upstream
/// sends it. With Nagle's algorithm on the broker's side, an event written while the one before
/// is still unacknowledged waits for the client's delayed ack, up to 40 ms later. Four answers
/// go over one connection the test opens itself, so every answer after the first is on a
/// connection past its first segments (which a client acks at once); the bound is far above the
/// upstream's 5 ms gap and below the stall, and the best of those three answers counts.
#[tokio::test]
async fn events_are_not_held_back_on_a_kept_alive_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (upstream, broker) = setup(Backend::Sqlite, "", "").await;
    let address = broker.url.trim_start_matches("http://").to_string();
    let mut connection = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut gaps = Vec::new();
    for n in 0..4 {
        let key = format!("kept-alive-{n}");
        let steps = vec![
            Step::Event("part 1".into()),
            Step::Wait(Duration::from_millis(5)),
            Step::Event("part 2".into()),
            Step::Done,
        ];
        upstream.script(&key, vec![Answer::Stream(steps)]);
        let request = format!(
            "POST {PATH} HTTP/1.1\r\nhost: {address}\r\nidempotency-key: {key}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        connection.write_all(request.as_bytes()).await.unwrap();
        // The answer is chunked: it ends with its last, empty chunk.
        let (mut seen, mut part_1_at) = (Vec::new(), None);
        while !seen.ends_with(b"0\r\n\r\n") {
            let mut buffer = [0u8; 16 * 1024];
            let read = connection.read(&mut buffer).await.unwrap();
            assert!(read > 0, "the broker closed the connection: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buffer[..read]);
            let text = String::from_utf8_lossy(&seen);
            if part_1_at.is_none() && text.contains("part 1") {
                part_1_at = Some(std::time::Instant::now());
            }
            if let (Some(at), true) = (part_1_at, text.contains("part 2")) {
                if gaps.len() == n {
                    gaps.push(at.elapsed());
                }
            }
        }
        assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    }
    let best = gaps[1..].iter().min().unwrap();
    assert!(*best < Duration::from_millis(25), "the second event came {gaps:?} after the first");
}

both_stores!(
    a_duplicate_that_cannot_join_a_stream_waits_for_its_record_instead,
    the_first_event_reaches_the_client_before_the_upstream_has_finished,
    a_503_before_the_first_byte_is_retried,
    a_client_that_disconnects_still_leaves_a_replayable_record,
    a_duplicate_of_a_done_stream_gets_the_same_bytes_status_and_headers,
    a_cut_after_the_third_event_is_unknown_keeps_the_partial_body_and_is_never_sent_again,
    a_cut_on_a_replay_safe_route_frees_the_key,
    a_cut_in_a_chunked_answer_aborts_the_clients_response_and_is_unknown,
    a_client_that_stops_reading_holds_the_upstream_no_longer_than_the_deadline,
    a_stall_past_the_idle_timeout_ends_the_stream_as_unknown,
    a_duplicate_that_waits_during_the_stream_attaches_and_gets_the_same_bytes,
    a_duplicate_waiting_before_the_stream_starts_attaches_when_it_does,
    an_answer_longer_than_max_stored_body_streams_through_but_is_never_replayed_nor_sent_again,
    a_cut_answer_too_long_to_keep_replays_the_operators_resolution,
);
