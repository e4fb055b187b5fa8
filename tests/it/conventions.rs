//! docs/agents.md: what it takes to stand in front of a real, authenticated API and speak the
//! conventions its SDKs already follow — credentials for the upstream, tenant tokens the way
//! SDKs send them, an honest 409, `x-should-retry`, the key echoed, keyless calls, and errors
//! an SDK can read.

use crate::common::JsonOf;

use crate::common::{both_stores, send, setup, Backend, Broker, Db, Reply, TestConfig, Upstream};

use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::Value;
use sha2::{Digest, Sha256};

const BODY: &str = r#"{"amount":42}"#;

fn header(upstream: &Upstream, op: &str, name: &str) -> Option<String> {
    upstream.headers(op).and_then(|h| h.get(name).map(|v| v.to_str().unwrap().to_string()))
}

/// Everything the broker keeps of a record, as the operator sees it.
async fn admin_record(broker: &Broker, key: &str) -> String {
    let listed: Value = broker.http.get(format!("{}/admin/requests", broker.admin)).json_of().await;
    let item = listed["items"].as_array().unwrap().iter().find(|r| r["key"] == key).expect("listed").clone();
    let url = format!("{}/admin/requests/{}", broker.admin, item["id"].as_str().unwrap());
    broker.http.get(url).send().await.unwrap().text().await.unwrap()
}

async fn configured_credentials_reach_the_upstream_and_are_never_stored(b: Backend) {
    std::env::set_var("IDEM_TEST_PAYMENTS_AUTH", "Bearer sk_live_upstream");
    let (upstream, broker) =
        setup(b, "upstream_headers_env = { Authorization = \"IDEM_TEST_PAYMENTS_AUTH\" }", "").await;
    // The client's own credential is for the broker, not the upstream.
    let r = send(broker.post("/payments", "cred-1", BODY).bearer_auth("client-token")).await;
    assert_eq!(r.status, 201);
    assert_eq!(header(&upstream, "cred-1", "authorization").as_deref(), Some("Bearer sk_live_upstream"));
    let kept = admin_record(&broker, "cred-1").await;
    assert!(!kept.contains("sk_live_upstream") && !kept.contains("client-token"), "{kept}");
    // The plain proxy path carries it too.
    let r = send(broker.http.get(format!("{}/payments/plain", broker.url))).await;
    assert_eq!(r.status, 201);
    assert_eq!(header(&upstream, "/payments/plain", "authorization").as_deref(), Some("Bearer sk_live_upstream"));
}

async fn a_forwarded_credential_reaches_the_upstream_and_scopes_the_keys(b: Backend) {
    let (upstream, broker) = setup(b, "forward_authorization = true", "").await;
    let a = send(broker.post("/payments", "shared", BODY).bearer_auth("sk_account_a")).await;
    assert_eq!(a.status, 201);
    assert_eq!(header(&upstream, "shared", "authorization").as_deref(), Some("Bearer sk_account_a"));
    // Another account, the same key: its own operation, not account a's answer.
    let b_answer = send(broker.post("/payments", "shared", r#"{"amount":7}"#).bearer_auth("sk_account_b")).await;
    assert_eq!(b_answer.status, 201, "{:?}", b_answer.body);
    assert_eq!(b_answer.header("idempotent-replayed"), None);
    assert_eq!(upstream.hits("shared"), 2);
    let again = send(broker.post("/payments", "shared", BODY).bearer_auth("sk_account_a")).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, a.body);
    // Each account sees its own record only; the credential is in none.
    let own: Value =
        broker.http.get(format!("{}/_idem/requests/shared", broker.url)).bearer_auth("sk_account_b").json_of().await;
    assert!(own["response"]["body"].as_str().unwrap().contains(r#"\"amount\":7"#), "{own}");
    let kept = admin_record(&broker, "shared").await;
    assert!(!kept.contains("sk_account"), "{kept}");
    let none = broker.http.get(format!("{}/_idem/requests/shared", broker.url)).send().await.unwrap();
    assert_eq!(none.status(), 404, "a caller without the credential sees nothing");
}

async fn a_forwarded_credential_is_not_sent_by_a_process_that_never_held_it(b: Backend) {
    let route = "forward_authorization = true";
    // A short lease: the restarted broker claims the handed-back record within a second or so.
    let retry = "[routes.retry]\nbase = \"10ms\"\ncap = \"50ms\"\n[worker]\nlease = \"1s\"\n";
    let upstream = Upstream::start().await;
    let db = Db::new(b).await;
    let first = Broker::start(&db, TestConfig::new(&upstream.url()).route(route).tables(retry)).await;
    upstream.script("handed", vec![Reply::status(503).header("retry-after", "2"), Reply::status(201)]);
    let r = send(first.post("/payments", "handed", BODY).bearer_auth("sk_a").header("prefer", "respond-async")).await;
    assert_eq!(r.status, 202);
    upstream.await_hits("handed", 1).await;
    // A graceful stop hands the waiting record back; the credential goes with the process.
    first.stop().await;
    let second = Broker::start(&db, TestConfig::new(&upstream.url()).route(route).tables(retry)).await;
    let scope = |r: reqwest::RequestBuilder| r.bearer_auth("sk_a");
    let until = Instant::now() + Duration::from_secs(10);
    let record = loop {
        let record: Value = scope(second.http.get(format!("{}/_idem/requests/handed", second.url))).json_of().await;
        if record["stop_reason"] == "credential_unavailable" {
            break record;
        }
        assert!(Instant::now() < until, "{record:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(record["state"], "not_started", "freed: nothing can have executed: {record:#}");
    assert_eq!(upstream.hits("handed"), 1, "sent without the client's credential");
    // The client's retry brings its credential again and executes.
    let r = send(second.post("/payments", "handed", BODY).bearer_auth("sk_a")).await;
    assert_eq!(r.status, 201);
    assert_eq!(header(&upstream, "handed", "authorization").as_deref(), Some("Bearer sk_a"));
}

fn tenant_section() -> String {
    std::env::set_var("IDEM_TEST_CONVENTIONS_ADMIN", "admin-secret");
    format!(
        "[auth]\nadmin_token_env = \"IDEM_TEST_CONVENTIONS_ADMIN\"\ntoken_header = \"x-api-key\"\n\
         [[auth.tenants]]\nname = \"acme\"\ntoken_sha256 = \"{}\"\n",
        hex::encode(Sha256::digest(b"acme-token"))
    )
}

async fn tenant_tokens_are_read_as_bearer_basic_or_a_named_header(b: Backend) {
    let (upstream, broker) = setup(b, "", &tenant_section()).await;
    let basic = |pair: &str| format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair));
    let ways = [
        ("authorization", "Bearer acme-token".to_string()),
        ("authorization", basic("acme-token:")),
        ("authorization", basic("api:acme-token")),
        ("x-api-key", "acme-token".to_string()),
    ];
    for (i, (name, value)) in ways.iter().enumerate() {
        let r = send(broker.post("/payments", &format!("t-{i}"), BODY).header(*name, value)).await;
        assert_eq!(r.status, 201, "{name}: {value}");
    }
    for (name, value) in [("authorization", basic("acme:wrong")), ("x-api-key", "wrong".to_string())] {
        let r = send(broker.post("/payments", "t-bad", BODY).header(name, value)).await;
        r.assert_problem(401, "unauthorized");
    }
    assert_eq!(upstream.hits("t-bad"), 0);
    // All four are one tenant's records.
    let r = send(broker.post("/payments", "t-0", BODY).header("x-api-key", "acme-token")).await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
}

async fn a_409_says_when_the_outcome_is_likely(b: Backend) {
    let (upstream, broker) = setup(b, "", "").await;
    // Teach the broker the route's pace: attempts take about half a second.
    send(broker.post("/payments?delay_ms=500", "pace", BODY)).await;
    let first = tokio::spawn(send(broker.post("/payments?delay_ms=500", "slow", BODY)));
    upstream.await_hits("slow", 1).await;
    let r = send(broker.post("/payments?delay_ms=500", "slow", BODY)).await;
    r.assert_problem(409, "request-in-progress");
    assert_eq!(r.header("retry-after"), Some("1"));
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!((50..=600).contains(&ms), "retry-after-ms {ms}");
    assert_eq!(r.json()["retry_after_ms"], ms);
    assert_eq!(r.header("x-should-retry"), Some("true"));
    assert_eq!(first.await.unwrap().status, 201);
}

async fn every_keyed_answer_says_whether_retrying_can_help_and_echoes_its_key(b: Backend) {
    let tenants = format!("{}\n", tenant_section());
    let retry = "[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\ndeadline = \"2s\"\n";
    let (upstream, broker) = setup(b, "max_body = \"1KiB\"", &format!("{retry}{tenants}")).await;
    let post = |key: &str, body: &str| broker.post("/payments", key, body).header("x-api-key", "acme-token");
    let check = |r: &crate::common::Answer, should: &str, what: &str| {
        assert_eq!(r.header("x-should-retry"), Some(should), "{what}: {:?}", r.body);
    };

    let r = send(post("fresh", BODY)).await;
    check(&r, "false", "a fresh 201");
    assert_eq!(r.header("idempotency-key"), Some("fresh"));
    let r = send(post("fresh", BODY)).await;
    check(&r, "false", "a replay");
    assert_eq!(r.header("idempotency-key"), Some("fresh"));
    let r = send(post("\"quoted\"", BODY)).await;
    assert_eq!(r.header("idempotency-key"), Some("\"quoted\""), "echoed as sent");
    let r = send(post("fresh", r#"{"amount":1}"#)).await;
    r.assert_problem(422, "idempotency-key-reused");
    check(&r, "false", "422");
    assert_eq!(r.header("idempotency-key"), Some("fresh"));
    let r =
        send(broker.http.post(format!("{}/payments", broker.url)).header("x-api-key", "acme-token").body(BODY)).await;
    r.assert_problem(400, "missing-idempotency-key");
    check(&r, "false", "400");
    let r = send(broker.post("/payments", "anon", BODY)).await;
    r.assert_problem(401, "unauthorized");
    check(&r, "false", "401");
    let r = send(post("big", &"x".repeat(2000))).await;
    r.assert_problem(413, "payload-too-large");
    check(&r, "false", "413");
    let r = send(broker.http.post(format!("{}/elsewhere", broker.url)).header("idempotency-key", "k")).await;
    r.assert_problem(404, "no-route");
    check(&r, "false", "404 no-route");

    upstream.script("unsure", vec![Reply::status(504)]);
    let r = send(post("unsure", BODY)).await;
    r.assert_problem(502, "outcome-unknown");
    check(&r, "false", "502 outcome-unknown");
    assert_eq!(r.header("idempotency-key"), Some("unsure"));

    // The broker retried already: the upstream's last 503 is relayed as final.
    upstream.script("down", vec![Reply::status(503), Reply::status(503), Reply::status(503)]);
    let r = send(post("down", BODY)).await;
    assert_eq!(r.status, 503);
    check(&r, "false", "503 relayed after the broker's retries");
    assert_eq!(upstream.hits("down"), 3);

    // An upstream that asks for more time than the deadline leaves: worth asking later.
    upstream.script("later", vec![Reply::status(503).header("retry-after", "60")]);
    let r = send(post("later", BODY)).await;
    assert_eq!(r.status, 503);
    check(&r, "true", "retry_after_beyond_deadline");
    let record: Value = broker
        .http
        .get(format!("{}/_idem/requests/later", broker.url))
        .header("x-api-key", "acme-token")
        .json_of()
        .await;
    assert_eq!(record["stop_reason"], "retry_after_beyond_deadline");
}

async fn a_route_that_does_not_require_keys_proxies_keyless_calls_unrecorded(b: Backend) {
    let (upstream, broker) = setup(b, "methods = [\"POST\", \"PUT\", \"PATCH\"]\nrequire_key = false", "").await;
    let r = send(broker.http.patch(format!("{}/payments/p1", broker.url)).body(BODY)).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotency-status"), None);
    let r = send(broker.http.patch(format!("{}/payments/p1", broker.url)).body(BODY)).await;
    assert_eq!(r.json()["n"], 2, "unrecorded: executed again");
    // Passed on as the upstream said it, but for what was meant for the hop to Idem alone.
    let said = Reply::status(202).header("x-kept", "yes").header("connection", "x-hop").header("x-hop", "no");
    upstream.script("/payments/p3", vec![said]);
    let r = send(broker.http.patch(format!("{}/payments/p3", broker.url)).body(BODY)).await;
    assert_eq!((r.status, r.header("x-kept")), (202, Some("yes")));
    assert_eq!(r.header("x-hop"), None, "named in the upstream's Connection: hop-by-hop");
    assert_eq!(std::str::from_utf8(&r.body).unwrap(), r#"{"status":202}"#);
    // A PUT with a key is recorded and replayed.
    let put = || broker.http.put(format!("{}/payments/p2", broker.url)).header("idempotency-key", "put-1").body(BODY);
    assert_eq!(send(put()).await.status, 201);
    let r = send(put()).await;
    assert_eq!(r.header("idempotent-replayed"), Some("true"));
    assert_eq!(upstream.hits("put-1"), 1);
    let metrics = broker.metrics().await;
    let unkeyed = metrics
        .lines()
        .find(|l| l.starts_with("idem_unkeyed_requests_total{") && l.contains("route=\"payments\""))
        .unwrap_or_else(|| panic!("no idem_unkeyed_requests_total:\n{metrics}"));
    // The recorder is the process's: the other store's run of this test may have counted too.
    assert!(unkeyed.rsplit(' ').next().unwrap().parse::<f64>().unwrap() >= 2.0, "{unkeyed}");
}

async fn problems_carry_an_error_object_that_sdks_read(b: Backend) {
    let (_upstream, broker) = setup(b, "", "").await;
    send(broker.post("/payments", "k", BODY)).await;
    let r = send(broker.post("/payments", "k", r#"{"amount":1}"#)).await;
    let p = r.json();
    assert_eq!(p["error"]["type"], "idempotency_error", "{p}");
    assert_eq!(p["error"]["code"], "idempotency-key-reused", "{p}");
    assert_eq!(p["error"]["message"], p["detail"], "{p}");
    assert_eq!(p["retryable"], false, "{p}");
}

both_stores!(
    configured_credentials_reach_the_upstream_and_are_never_stored,
    a_forwarded_credential_reaches_the_upstream_and_scopes_the_keys,
    a_forwarded_credential_is_not_sent_by_a_process_that_never_held_it,
    tenant_tokens_are_read_as_bearer_basic_or_a_named_header,
    a_409_says_when_the_outcome_is_likely,
    every_keyed_answer_says_whether_retrying_can_help_and_echoes_its_key,
    a_route_that_does_not_require_keys_proxies_keyless_calls_unrecorded,
    problems_carry_an_error_object_that_sdks_read,
);
