//! The answer table of docs/concepts.md, row by row, through real HTTP: a broker on port 0 in front of a fake upstream.

use crate::common::{both_stores, setup, Backend, Db};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{send, Answer, Broker, Gate, Reply, TestConfig, Upstream};
use idem::domain::clock::ManualClock;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const BODY: &str = r#"{"amount":42,"currency":"eur"}"#;

async fn a_request_without_a_key_is_refused_and_nothing_is_sent(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let r = send(broker.http.post(format!("{}/payments", broker.url)).body(BODY)).await;
    r.assert_problem(400, "missing-idempotency-key");
    assert_eq!(r.header("idempotency-status"), Some("not_started"));
    assert_eq!(upstream.hits("/payments"), 0);
}

async fn empty_long_or_invisible_keys_are_refused(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let long = "k".repeat(256);
    for key in ["", "\"\"", long.as_str(), "with space", "\"tab\there\""] {
        let r = send(broker.post("/payments", key, BODY)).await;
        r.assert_problem(400, "invalid-idempotency-key");
        assert_eq!(r.header("idempotency-status"), Some("not_started"));
    }
    let r = send(broker.post("/payments", "k", BODY).header("idempotency-key", "second")).await;
    r.assert_problem(400, "invalid-idempotency-key");
    assert_eq!(upstream.hits("/payments"), 0);
    // 255 characters is still a key.
    let ok = send(broker.post("/payments", &"k".repeat(255), BODY)).await;
    assert_eq!(ok.status, 201);
}

async fn an_oversize_body_is_refused_and_nothing_is_recorded(b: Backend) {
    let (upstream, broker) = setup(b, "max_body = \"1KiB\"", "").await;
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2000));
    let r = send(broker.post("/payments", "big", &big)).await;
    r.assert_problem(413, "payload-too-large");
    assert_eq!(broker.record("big").await.status(), 404);

    // Without a Content-Length (chunked), the limit still holds.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big.as_bytes().chunks(256).map(|c| Ok(c.to_vec())).collect();
    let r = send(
        broker
            .http
            .post(format!("{}/payments", broker.url))
            .header("idempotency-key", "big-chunked")
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))),
    )
    .await;
    r.assert_problem(413, "payload-too-large");
    assert_eq!(broker.record("big-chunked").await.status(), 404);
    assert_eq!(upstream.hits("big") + upstream.hits("big-chunked"), 0);
}

/// Two tenants, and the admin token that tenants require.
fn tenants_section() -> String {
    std::env::set_var("IDEM_TEST_TENANTS_ADMIN_TOKEN", "tenants-admin-secret");
    let digest = |t: &str| hex::encode(Sha256::digest(t.as_bytes()));
    format!(
        "[auth]\nadmin_token_env = \"IDEM_TEST_TENANTS_ADMIN_TOKEN\"\n[[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n[[auth.tenants]]\nname = \"globex\"\ntoken_sha256 = \"{}\"\n",
        digest("acme-token"),
        digest("globex-token")
    )
}

async fn a_bad_or_missing_token_is_unauthorized_when_tenants_are_configured(b: Backend) {
    let (upstream, broker) = setup(b, "", &tenants_section()).await;
    let r = send(broker.post("/payments", "k1", BODY)).await;
    r.assert_problem(401, "unauthorized");
    let r = send(broker.post("/payments", "k1", BODY).bearer_auth("wrong")).await;
    r.assert_problem(401, "unauthorized");
    let r = send(broker.post("/payments", "k1", BODY).header("authorization", "Basic YWNtZTp4")).await;
    r.assert_problem(401, "unauthorized");
    assert_eq!(upstream.hits("k1"), 0);
    let r = send(broker.post("/payments", "k1", BODY).bearer_auth("acme-token")).await;
    assert_eq!(r.status, 201);
}

async fn a_path_outside_every_route_is_no_route(b: Backend) {
    let (_upstream, broker) = setup(b, "", "").await;
    let r = send(broker.post("/elsewhere", "k", BODY)).await;
    r.assert_problem(404, "no-route");
    // A prefix matches whole segments only.
    let r = send(broker.post("/paymentsX", "k", BODY)).await;
    r.assert_problem(404, "no-route");
}

async fn a_new_key_is_executed_and_the_upstream_answer_returned(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let r = send(broker.post("/payments/charges?expand=1", "new-1", BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotency-status"), Some("done"));
    assert_eq!(r.header("x-upstream"), Some("fake"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(r.header("idempotent-replayed").is_none());
    let body = r.json();
    assert_eq!(body["n"], 1);
    assert_eq!(body["echo"], BODY);
    assert_eq!(upstream.hits("new-1"), 1);

    let record = broker.record_json("new-1").await;
    assert_eq!(record["state"], "done");
    assert_eq!(record["path"], "/payments/charges?expand=1");
    assert_eq!(record["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(record["attempts"][0]["status"], 201);
    assert_eq!(record["stop_reason"], "success");
}

async fn an_exact_duplicate_gets_the_stored_response_byte_for_byte(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let first = send(broker.post("/payments", "dup", BODY)).await;
    let second = send(broker.post("/payments", "dup", BODY)).await;
    let third = send(broker.post("/payments", "\"dup\"", BODY)).await;
    for replay in [&second, &third] {
        assert_eq!(replay.status, first.status);
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.header("idempotency-status"), Some("done"));
        assert_eq!(replay.header("x-upstream"), Some("fake"));
    }
    assert_eq!(upstream.hits("dup"), 1);
    // The upstream's hop-by-hop `connection: keep-alive` is not stored; its own headers are.
    let stored = &broker.record_json("dup").await["response"]["headers"];
    assert!(stored.get("connection").is_none(), "{stored}");
    assert_eq!(stored["x-upstream"], "fake");
}

async fn a_reserialised_json_body_is_the_same_request(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let first = send(broker.post("/payments", "json", r#"{"a":1,"b":2}"#)).await;
    let again = send(broker.post("/payments", "json", "{ \"b\": 2,\n \"a\": 1 }")).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("json"), 1);
    // A number beyond f64 is JSON too, compared as written: reordered, it is the same request.
    let first = send(broker.post("/payments", "huge", r#"{"a":1e999999,"b":2}"#)).await;
    let again = send(broker.post("/payments", "huge", r#"{"b":2,"a":1e999999}"#)).await;
    assert_eq!((again.status, &again.body), (201, &first.body));
    let other = send(broker.post("/payments", "huge", r#"{"b":2,"a":1e999998}"#)).await;
    other.assert_problem(422, "idempotency-key-reused");
    assert_eq!(upstream.hits("huge"), 1);
}

async fn a_duplicate_with_another_body_is_refused(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    send(broker.post("/payments", "reuse", BODY)).await;
    let r = send(broker.post("/payments", "reuse", r#"{"amount":43,"currency":"eur"}"#)).await;
    r.assert_problem(422, "idempotency-key-reused");
    assert_eq!(r.header("idempotency-status"), Some("done"));
    // Another path or method with the same key is another request too.
    let r = send(broker.post("/payments/other", "reuse", BODY)).await;
    r.assert_problem(422, "idempotency-key-reused");
    assert_eq!(upstream.hits("reuse"), 1);
}

async fn a_concurrent_duplicate_is_told_the_request_is_in_progress(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let slow = broker.post("/payments?delay_ms=800", "busy", BODY);
    let first = tokio::spawn(async move { send(slow).await });
    upstream.await_hits("busy", 1).await;
    let r = send(broker.post("/payments?delay_ms=800", "busy", BODY)).await;
    r.assert_problem(409, "request-in-progress");
    assert_eq!(r.header("idempotency-status"), Some("in_progress"));
    let retry_after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry_after));
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(upstream.hits("busy"), 1);
}

async fn prefer_wait_waits_for_the_outcome_instead_of_409(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let slow = broker.post("/payments?delay_ms=500", "patient", BODY);
    let first = tokio::spawn(async move { send(slow).await });
    upstream.await_hits("patient", 1).await;
    let waited = send(broker.post("/payments?delay_ms=500", "patient", BODY).header("prefer", "wait=10")).await;
    let first = first.await.unwrap();
    assert_eq!(waited.status, 201);
    assert_eq!(waited.body, first.body);
    assert_eq!(waited.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("patient"), 1);

    // A wait shorter than the execution ends in 409 after about that long.
    let slow = broker.post("/payments?delay_ms=3000", "impatient", BODY);
    let first = tokio::spawn(async move { send(slow).await });
    upstream.await_hits("impatient", 1).await;
    let started = Instant::now();
    let r = send(broker.post("/payments?delay_ms=3000", "impatient", BODY).header("prefer", "wait=1")).await;
    r.assert_problem(409, "request-in-progress");
    assert!(started.elapsed() >= Duration::from_millis(900), "answered after {:?}", started.elapsed());
    assert_eq!(first.await.unwrap().status, 201);
}

async fn a_timeout_on_a_route_that_is_not_replay_safe_is_an_unknown_outcome(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nper_try_timeout = \"300ms\"\nmin_try = \"100ms\"\n").await;
    upstream.script("hung", vec![Reply::hang()]);
    let r = send(broker.post("/payments", "hung", BODY)).await;
    r.assert_problem(502, "outcome-unknown");
    assert_eq!(r.header("idempotency-status"), Some("unknown"));
    let again = send(broker.post("/payments", "hung", BODY)).await;
    again.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.hits("hung"), 1, "an unknown outcome is never sent again");
    let record = broker.record_json("hung").await;
    assert_eq!(record["state"], "unknown");
    assert_eq!(record["stop_reason"], "unsafe_replay");
    assert_eq!(record["attempts"][0]["outcome"], "ambiguous");
    assert_eq!(record["attempts"][0]["error"], "timed_out");
}

async fn an_ambiguous_status_on_a_route_that_is_not_replay_safe_is_an_unknown_outcome(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    upstream.script("gw", vec![Reply::status(504)]);
    let r = send(broker.post("/payments", "gw", BODY)).await;
    r.assert_problem(502, "outcome-unknown");
    assert_eq!(upstream.hits("gw"), 1);
}

async fn respond_async_answers_202_with_the_record_location(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let r = send(broker.post("/payments?delay_ms=300", "later/1", BODY).header("prefer", "respond-async")).await;
    assert_eq!(r.status, 202);
    assert_eq!(r.header("location"), Some("/_idem/requests/later%2F1"));
    // Queued, or already claimed by a free worker: the header tells the record's state.
    let accepted = r.json();
    assert_eq!(r.header("idempotency-status"), accepted["state"].as_str());
    assert!(matches!(accepted["state"].as_str(), Some("not_started" | "in_progress")), "{accepted}");
    assert_eq!(accepted["key"], "later/1");
    let location = format!("{}{}", broker.url, r.header("location").unwrap());
    let until = Instant::now() + Duration::from_secs(10);
    let record = loop {
        let v: serde_json::Value = broker.http.get(&location).send().await.unwrap().json().await.unwrap();
        if v["state"] == "done" || Instant::now() > until {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(record["state"], "done");
    assert_eq!(record["response"]["status"], 201);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(record["response"]["body"].as_str().unwrap()).unwrap()["n"],
        1
    );
    assert_eq!(upstream.hits("later/1"), 1);
}

async fn the_record_is_visible_to_its_tenant_only(b: Backend) {
    let (_upstream, broker) = setup(b, "", &tenants_section()).await;
    send(broker.post("/payments", "mine", BODY).bearer_auth("acme-token")).await;
    let get = |token: &'static str| broker.http.get(format!("{}/_idem/requests/mine", broker.url)).bearer_auth(token);
    let r = send(get("acme-token")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("idempotency-status"), Some("done"));
    let v = r.json();
    for field in [
        "id",
        "tenant",
        "key",
        "route",
        "method",
        "path",
        "state",
        "fingerprint",
        "attempts",
        "stop_reason",
        "created_at",
        "updated_at",
        "response",
    ] {
        assert!(v.get(field).is_some(), "record lacks {field}: {v}");
    }
    assert_eq!(v["tenant"], "acme");
    assert_eq!(v["key"], "mine");
    assert_eq!(v["method"], "POST");
    assert_eq!(v["fingerprint"].as_str().unwrap().len(), 64);
    assert!(v["created_at"].as_str().unwrap().ends_with('Z'));
    assert!(v["attempts"][0]["started_at"].as_str().is_some());
    assert!(v["attempts"][0]["duration_ms"].as_u64().is_some());
    assert!(v["attempts"][0]["wait_ms"].as_u64().is_some());
    assert_eq!(v["response"]["status"], 201);
    assert!(v.get("request").is_none(), "the request body is not shown");

    send(get("globex-token")).await.assert_problem(404, "request-not-found");
    send(get("nobody")).await.assert_problem(401, "unauthorized");
}

async fn the_same_key_under_two_tenants_is_two_requests(b: Backend) {
    let (upstream, broker) = setup(b, "", &tenants_section()).await;
    let a = send(broker.post("/payments", "shared", BODY).bearer_auth("acme-token")).await;
    let b = send(broker.post("/payments", "shared", r#"{"other":"body"}"#).bearer_auth("globex-token")).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(b.header("idempotent-replayed").is_none());
    assert_eq!(a.json()["n"], 1);
    assert_eq!(b.json()["n"], 2);
    assert_eq!(upstream.hits("shared"), 2);
    let replay = send(broker.post("/payments", "shared", BODY).bearer_auth("acme-token")).await;
    assert_eq!(replay.body, a.body);
}

async fn methods_without_a_key_requirement_are_proxied_unrecorded(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    for _ in 0..2 {
        let r = send(broker.http.get(format!("{}/payments/42?x=1", broker.url))).await;
        assert_eq!(r.status, 201);
        assert!(r.header("idempotency-status").is_none());
    }
    assert_eq!(upstream.hits("/payments/42"), 2);
    // A GET with a key is proxied too, and nothing is recorded under it.
    let r = send(broker.http.get(format!("{}/payments/7", broker.url)).header("idempotency-key", "get-key")).await;
    assert_eq!(r.status, 201);
    assert_eq!(broker.record("get-key").await.status(), 404);
}

async fn a_head_passed_through_says_the_length_the_upstream_said(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let get = send(broker.http.get(format!("{}/payments/42", broker.url))).await;
    let head = send(broker.http.head(format!("{}/payments/42", broker.url))).await;
    assert_eq!(head.status, 201);
    assert!(head.body.is_empty());
    let length = get.header("content-length").expect("a GET's answer has its length");
    assert_ne!(length, "0");
    assert_eq!(head.header("content-length"), Some(length));
    assert_eq!(upstream.hits("/payments/42"), 2);
}

async fn credentials_and_hop_by_hop_headers_are_not_forwarded(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    send(
        broker
            .post("/payments", "hdr", BODY)
            .header("authorization", "Bearer client-secret")
            .header("cookie", "session=abc")
            .header("x-trace", "t-1")
            .header("prefer", "wait=1"),
    )
    .await;
    let seen = upstream.headers("hdr").unwrap();
    assert!(seen.get("authorization").is_none());
    assert!(seen.get("cookie").is_none());
    assert!(seen.get("prefer").is_none());
    assert_eq!(seen.get("x-trace").unwrap(), "t-1");
    assert_eq!(seen.get("idempotency-key").unwrap(), "hdr");
}

async fn the_key_is_not_forwarded_when_the_route_says_so(b: Backend) {
    let (upstream, broker) = setup(b, "forward_idempotency_key = false", "").await;
    send(broker.post("/payments/nokey", "secret-key", BODY)).await;
    assert_eq!(upstream.hits("secret-key"), 0);
    let seen = upstream.headers("/payments/nokey").unwrap();
    assert!(seen.get("idempotency-key").is_none());
}

async fn sixty_four_concurrent_duplicates_execute_once_and_agree(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let broker = Arc::new(broker);
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let b = broker.clone();
        tasks.push(tokio::spawn(async move { send(b.post("/payments?delay_ms=200", "storm", BODY)).await }));
    }
    let mut answers: Vec<Answer> = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert_eq!(upstream.hits("storm"), 1);
    let finals: Vec<&Answer> = answers.iter().filter(|a| a.status != 409).collect();
    assert!(!finals.is_empty());
    for a in &finals {
        assert_eq!(a.status, 201);
        assert_eq!(a.body, finals[0].body);
    }
    for a in answers.iter().filter(|a| a.status == 409) {
        a.assert_problem(409, "request-in-progress");
    }
    // After the storm, everyone agrees.
    let late = send(broker.post("/payments?delay_ms=200", "storm", BODY)).await;
    assert_eq!(late.body, finals[0].body);
}

async fn a_replay_survives_a_broker_restart(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url())).await;
    let first = send(broker.post("/payments", "durable", BODY)).await;
    broker.stop().await;
    let broker = Broker::start(&db, TestConfig::new(&upstream.url())).await;
    let replay = send(broker.post("/payments", "durable", BODY)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("durable"), 1);
}

async fn an_unreachable_upstream_frees_the_key_and_the_next_request_executes(b: Backend) {
    // Reserve a port, then close it: connections are refused, so nothing can have been sent.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let broker = Broker::start(
        &Db::new(b).await,
        TestConfig::new(&format!("http://{addr}")).tables("[routes.retry]\nmax_attempts = 1\n"),
    )
    .await;
    let r = send(broker.post("/payments", "down", BODY)).await;
    r.assert_problem(503, "upstream-unavailable");
    assert_eq!(r.header("idempotency-status"), Some("not_started"));
    let record = broker.record_json("down").await;
    assert_eq!(record["state"], "not_started");
    assert_eq!(record["queued"], false);
    assert_eq!(record["attempts"][0]["error"], "connect_failed");

    // The upstream comes up on that port: the same key now executes.
    let upstream = Upstream::serve(tokio::net::TcpListener::bind(addr).await.unwrap()).await;
    let r = send(broker.post("/payments", "down", BODY)).await;
    assert_eq!(r.status, 201);
    assert!(r.header("idempotent-replayed").is_none());
    assert_eq!(upstream.hits("down"), 1);
    assert_eq!(broker.record_json("down").await["state"], "done");
}

async fn a_not_processed_status_frees_the_key_and_returns_the_upstream_answer(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nmax_attempts = 1\n").await;
    upstream.script("busy-503", vec![Reply::status(503).header("retry-after", "7")]);
    let r = send(broker.post("/payments", "busy-503", BODY)).await;
    assert_eq!((r.status, r.header("retry-after")), (503, Some("7")), "not the upstream's answer: {r:?}");
    assert_eq!(r.header("idempotency-status"), Some("not_started"));
    assert_eq!(broker.record_json("busy-503").await["stop_reason"], "attempt_cap");
    let r = send(broker.post("/payments", "busy-503", BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(upstream.hits("busy-503"), 2);
}

async fn client_errors_and_500s_are_final_and_replayed(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    for (key, status) in [("e400", 400), ("e500", 500)] {
        let first = send(broker.post(&format!("/payments?status={status}"), key, BODY)).await;
        assert_eq!(first.status, status);
        assert_eq!(first.header("idempotency-status"), Some("done"));
        let replay = send(broker.post(&format!("/payments?status={status}"), key, BODY)).await;
        assert_eq!(replay.status, status);
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(upstream.hits(key), 1);
    }
}

/// A client that hangs up while the upstream holds its request cancels nothing. Its execution
/// ran on the request's own task; once the broker has dropped the request (it let go of its
/// body), the upstream answers, and the execution, on a task of its own now, stores that answer:
/// executed once, replayed to a duplicate.
async fn a_client_that_disconnects_does_not_cancel_the_execution(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    let gate = Gate::closed();
    upstream.script("gone", vec![Reply::status(201).held_by(&gate)]);
    let mut client = TcpStream::connect(broker.url.trim_start_matches("http://")).await.unwrap();
    let request = format!(
        "POST /payments HTTP/1.1\r\nhost: idem\r\nidempotency-key: gone\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    upstream.await_hits("gone", 1).await;
    assert!(broker.buffered_body_bytes().await > 0, "the waiting request holds its body");

    drop(client);
    let until = Instant::now() + Duration::from_secs(10);
    while broker.buffered_body_bytes().await > 0 {
        assert!(Instant::now() < until, "the broker never dropped the request of the client that left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(broker.record_json("gone").await["state"], "in_progress", "the execution is still held");
    gate.open();

    let record = broker.await_record("gone", Duration::from_secs(10), |v| v["state"] == "done").await;
    assert_eq!(record["response"]["status"], 201);
    let replay = send(broker.post("/payments", "gone", BODY)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(std::str::from_utf8(&replay.body).unwrap(), r#"{"status":201}"#, "the upstream's answer");
    assert_eq!(upstream.hits("gone"), 1);
}

/// A client whose wait ends first (its deadline and five seconds) cancels nothing either. The
/// broker's one worker is held by another key's request, which the upstream keeps; the waiting
/// key's execution waits for that worker on its request's own task, past the request's patience.
/// The client is answered from the record (not started yet), and the execution, on a task of its
/// own now, runs once the worker is free. The broker's clock stands still, so the deadline the
/// client shortened to a second is still whole then.
async fn a_client_whose_wait_ends_first_does_not_cancel_the_execution(b: Backend) {
    let upstream = Upstream::start().await;
    let clock = Arc::new(ManualClock::starting_now());
    let config =
        TestConfig::new(&upstream.url()).worker("concurrency = 1").route("deadline_header = \"Request-Timeout-Ms\"");
    let broker = Broker::start_with_clock(&Db::new(b).await, config, clock).await;
    let gate = Gate::closed();
    upstream.script("holder", vec![Reply::status(201).held_by(&gate)]);
    let holder = tokio::spawn(broker.post("/payments", "holder", BODY).send());
    upstream.await_hits("holder", 1).await;

    let patient = send(broker.post("/payments", "patient", BODY).header("request-timeout-ms", "1000")).await;
    assert_eq!(patient.status, 409, "{:?}", patient.body);
    assert_eq!(patient.header("idempotency-status"), Some("not_started"), "it waits for the worker");
    assert_eq!(upstream.hits("patient"), 0);
    gate.open();
    assert_eq!(holder.await.unwrap().unwrap().status(), 201);

    let record = broker.await_record("patient", Duration::from_secs(10), |v| v["state"] == "done").await;
    assert_eq!(record["response"]["status"], 201);
    let replay = send(broker.post("/payments", "patient", BODY)).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.json()["key"], "patient");
    assert_eq!(upstream.hits("patient"), 1);
}

/// Without a tombstone (see tests/agents.rs for the route that keeps one).
async fn done_records_expire_after_retention_and_the_key_executes_afresh(b: Backend) {
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let text = crate::common::TestConfig::new(&upstream.url())
        .store(&db.url)
        .route("tombstone = \"0s\"")
        .text()
        .replace("[store]\n", "[store]\nretention = \"1s\"\n");
    let broker = Broker::start_with(&db, text).await;
    let first = send(broker.post("/payments", "brief", BODY)).await;
    assert_eq!(first.json()["n"], 1);
    // The sweep deletes it within a couple of seconds.
    let until = Instant::now() + Duration::from_secs(10);
    while broker.record("brief").await.status() != 404 {
        assert!(Instant::now() < until, "the record was never swept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let again = send(broker.post("/payments", "brief", BODY)).await;
    assert_eq!(again.status, 201);
    assert!(again.header("idempotent-replayed").is_none());
    assert_eq!(again.json()["n"], 2);
}

async fn a_cancelled_request_starts_no_further_attempt(b: Backend) {
    let (upstream, broker) = setup(b, "", "[routes.retry]\nbase = \"5s\"\ncap = \"5s\"\njitter = \"none\"\n").await;
    upstream.script("stop-me", vec![Reply::status(503)]);
    let r = send(broker.post("/payments", "stop-me", BODY).header("prefer", "respond-async")).await;
    assert_eq!(r.status, 202);
    // The first attempt fails with 503; the worker now waits 5 s before the next.
    broker
        .await_record("stop-me", Duration::from_secs(5), |v| v["attempts"].as_array().is_some_and(|a| a.len() == 1))
        .await;
    let started = Instant::now();
    let r = send(broker.http.delete(format!("{}/_idem/requests/stop-me", broker.url))).await;
    assert_eq!(r.status, 202);
    let record = broker.await_record("stop-me", Duration::from_secs(3), |v| v["state"] == "not_started").await;
    assert!(started.elapsed() < Duration::from_secs(3), "the wait was not cut short");
    assert_eq!(record["stop_reason"], "cancelled");
    assert_eq!(record["history"][0]["action"], "cancel");
    assert_eq!(upstream.hits("stop-me"), 1);
    // Nothing is left to cancel.
    send(broker.http.delete(format!("{}/_idem/requests/stop-me", broker.url)))
        .await
        .assert_problem(409, "request-not-cancellable");
}

/// The forwarding headers the upstream got with `op`: the same with each of its attempts.
fn forwarded_as_seen(upstream: &Upstream, op: &str) -> (String, String, String) {
    let seen: Vec<_> = upstream
        .every_headers(op)
        .iter()
        .map(|headers| {
            let all =
                |name: &str| headers.get_all(name).iter().map(|v| v.to_str().unwrap()).collect::<Vec<_>>().join(" | ");
            (all("x-forwarded-for"), all("x-forwarded-proto"), all("forwarded"))
        })
        .collect();
    let first = seen.first().unwrap_or_else(|| panic!("{op} never reached the upstream")).clone();
    assert!(seen.iter().all(|s| *s == first), "the attempts of {op} were told different origins: {seen:#?}");
    first
}

async fn the_upstream_is_told_the_clients_address_and_not_what_the_client_claims(b: Backend) {
    let (upstream, broker) =
        setup(b, "", "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\nnot_processed = [503]").await;
    upstream.script("spoofed", vec![Reply::status(503), Reply::status(201)]);
    let spoofed = broker
        .post("/payments", "spoofed", BODY)
        .header("x-forwarded-for", "6.6.6.6")
        .header("forwarded", "for=6.6.6.6")
        .header("x-forwarded-proto", "https");
    assert_eq!(send(spoofed).await.status, 201);
    // The retry carries what the first attempt did: it was stored with the request.
    assert_eq!(upstream.hits("spoofed"), 2);
    let expected = ("127.0.0.1".to_string(), "http".to_string(), "for=127.0.0.1;proto=http".to_string());
    assert_eq!(forwarded_as_seen(&upstream, "spoofed"), expected);
    // A request proxied without a key is told the same.
    let plain = broker.http.get(format!("{}/payments/status", broker.url)).header("x-forwarded-for", "6.6.6.6");
    assert_eq!(send(plain).await.status, 201);
    assert_eq!(forwarded_as_seen(&upstream, "/payments/status"), expected);
}

async fn a_trusted_proxys_forwarding_is_extended_and_forwarding_can_be_turned_off(b: Backend) {
    let db = Db::new(b).await;
    let upstream = Upstream::start().await;
    let config = TestConfig::new(&upstream.url()).server("trusted_proxies = [\"127.0.0.0/8\"]");
    let broker = Broker::start(&db, config).await;
    let proxied = broker
        .post("/payments", "via-proxy", BODY)
        .header("x-forwarded-for", "203.0.113.5")
        .header("forwarded", "for=203.0.113.5;proto=https")
        .header("x-forwarded-proto", "https");
    assert_eq!(send(proxied).await.status, 201);
    assert_eq!(
        forwarded_as_seen(&upstream, "via-proxy"),
        (
            "203.0.113.5, 127.0.0.1".to_string(),
            "https".to_string(),
            "for=203.0.113.5;proto=https, for=127.0.0.1;proto=http".to_string()
        )
    );
    broker.stop().await;

    let broker = Broker::start(&db, TestConfig::new(&upstream.url()).server("forwarded = false")).await;
    let sent = broker.post("/payments", "not-forwarded", BODY).header("x-forwarded-for", "203.0.113.5");
    assert_eq!(send(sent).await.status, 201);
    assert_eq!(
        forwarded_as_seen(&upstream, "not-forwarded"),
        ("203.0.113.5".to_string(), String::new(), String::new())
    );
    broker.stop().await;
}

both_stores!(
    the_upstream_is_told_the_clients_address_and_not_what_the_client_claims,
    a_trusted_proxys_forwarding_is_extended_and_forwarding_can_be_turned_off,
    a_request_without_a_key_is_refused_and_nothing_is_sent,
    empty_long_or_invisible_keys_are_refused,
    an_oversize_body_is_refused_and_nothing_is_recorded,
    a_bad_or_missing_token_is_unauthorized_when_tenants_are_configured,
    a_path_outside_every_route_is_no_route,
    a_new_key_is_executed_and_the_upstream_answer_returned,
    an_exact_duplicate_gets_the_stored_response_byte_for_byte,
    a_reserialised_json_body_is_the_same_request,
    a_duplicate_with_another_body_is_refused,
    a_concurrent_duplicate_is_told_the_request_is_in_progress,
    prefer_wait_waits_for_the_outcome_instead_of_409,
    a_timeout_on_a_route_that_is_not_replay_safe_is_an_unknown_outcome,
    an_ambiguous_status_on_a_route_that_is_not_replay_safe_is_an_unknown_outcome,
    respond_async_answers_202_with_the_record_location,
    the_record_is_visible_to_its_tenant_only,
    the_same_key_under_two_tenants_is_two_requests,
    methods_without_a_key_requirement_are_proxied_unrecorded,
    a_head_passed_through_says_the_length_the_upstream_said,
    credentials_and_hop_by_hop_headers_are_not_forwarded,
    the_key_is_not_forwarded_when_the_route_says_so,
    sixty_four_concurrent_duplicates_execute_once_and_agree,
    a_replay_survives_a_broker_restart,
    an_unreachable_upstream_frees_the_key_and_the_next_request_executes,
    a_not_processed_status_frees_the_key_and_returns_the_upstream_answer,
    client_errors_and_500s_are_final_and_replayed,
    a_client_that_disconnects_does_not_cancel_the_execution,
    a_client_whose_wait_ends_first_does_not_cancel_the_execution,
    done_records_expire_after_retention_and_the_key_executes_afresh,
    a_cancelled_request_starts_no_further_attempt,
);
