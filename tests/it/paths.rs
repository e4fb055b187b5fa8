//! docs/security.md: the path a route matches is the path stored and the path sent. A path that a URL
//! parser on the way could rewrite — a `.` or `..` segment, literal or percent-encoded in any
//! case — is refused with 400 `invalid-path`, nothing recorded and nothing sent.
//!
//! Requests go out over a raw socket: an HTTP client library would resolve the dot-segments
//! itself before sending, and so never show what the broker does with them.

use crate::common::{both_stores, Backend, Broker, Db, TestConfig, Upstream};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BODY: &str = r#"{"amount":42}"#;

/// A broker with `payments` at `/payments` in front of the upstream's root, and `orders` at
/// `/orders` in front of its base path `/orders-api`.
async fn setup(b: Backend) -> (Upstream, Broker) {
    let upstream = Upstream::start().await;
    let orders = format!(
        "[[routes]]\nname = \"orders\"\npath_prefix = \"/orders\"\nupstream = \"{}/orders-api\"\n",
        upstream.url()
    );
    let broker = Broker::start(&Db::new(b).await, TestConfig::new(&upstream.url()).tables(&orders)).await;
    (upstream, broker)
}

/// The status and body of one request sent exactly as written.
async fn raw(broker: &Broker, method: &str, target: &str, key: Option<&str>) -> (u16, String) {
    let addr = broker.url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let key = key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
    let body = if method == "GET" { "" } else { BODY };
    let request = format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\n{key}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status line: {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

fn assert_invalid_path(status: u16, body: &str, sent: &str) {
    assert_eq!(status, 400, "{sent}: {body}");
    let problem: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{sent}: not JSON: {body}"));
    assert_eq!(problem["type"], "urn:idem:problem:invalid-path", "{sent}: {problem}");
    assert!(problem["detail"].as_str().is_some_and(|d| d.contains("..")), "{sent}: {problem}");
}

/// Each path of the table, sent as a plain GET and as a keyed POST: refused, and the upstream
/// sees nothing.
async fn dot_segments_are_refused_and_never_reach_the_upstream(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let paths = [
        "/payments/../_idem/requests/x",
        "/payments/../admin-secret",
        "/payments/%2e%2e/secret",
        "/payments/%2E%2E/secret",
        "/payments/.%2e/secret",
        "/payments/%2E./secret",
        "/payments/./secret",
        "/payments/..%2fsecret",
        "/payments/..;x/secret",
        "/orders/../../x",
        "/orders/%2e%2e/%2e%2e/x",
    ];
    for (i, path) in paths.iter().enumerate() {
        let (status, body) = raw(&broker, "GET", path, None).await;
        assert_invalid_path(status, &body, &format!("GET {path}"));
        let key = format!("dots-{i}");
        let (status, body) = raw(&broker, "POST", path, Some(&key)).await;
        assert_invalid_path(status, &body, &format!("POST {path}"));
        assert_eq!(broker.record(&key).await.status(), 404, "POST {path} was recorded");
    }
    assert_eq!(upstream.received(), Vec::<String>::new());
}

/// What is matched is what arrives: the upstream's base path kept, encoded bytes left encoded.
async fn the_upstream_receives_the_path_as_matched(b: Backend) {
    let (upstream, broker) = setup(b).await;
    let (status, _) = raw(&broker, "POST", "/orders/7?expand=1", Some("order-7")).await;
    assert_eq!(status, 201);
    let (status, _) = raw(&broker, "GET", "/payments/a%2Fb/v1.2/...", None).await;
    assert_eq!(status, 201);
    let (status, _) = raw(&broker, "POST", "/payments/%2e%2e%2e", Some("three-dots")).await;
    assert_eq!(status, 201);
    assert_eq!(
        upstream.received(),
        ["POST /orders-api/orders/7?expand=1", "GET /payments/a%2Fb/v1.2/...", "POST /payments/%2e%2e%2e"]
    );
    let record = broker.record_json("order-7").await;
    assert_eq!(record["path"], "/orders/7?expand=1");
}

/// Characters that a URL parser would percent-encode change the path on the way: refused too.
async fn a_path_the_client_would_re_encode_is_refused(b: Backend) {
    let (upstream, broker) = setup(b).await;
    for (i, path) in ["/payments/{x}", "/payments/a\\b"].iter().enumerate() {
        let (status, body) = raw(&broker, "POST", path, Some(&format!("encoded-{i}"))).await;
        if status == 400 {
            let problem: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(problem["type"], "urn:idem:problem:invalid-path", "{path}: {problem}");
        } else {
            panic!("POST {path}: {status} {body}");
        }
        assert_eq!(broker.record(&format!("encoded-{i}")).await.status(), 404);
    }
    assert_eq!(upstream.received(), Vec::<String>::new());
}

both_stores!(
    dot_segments_are_refused_and_never_reach_the_upstream,
    the_upstream_receives_the_path_as_matched,
    a_path_the_client_would_re_encode_is_refused,
);
