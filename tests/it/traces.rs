//! Traces: a real `idem serve` exporting over OTLP/HTTP to a receiver here that decodes the
//! protobuf it gets, as a collector would. One trace per request, the client's trace id kept;
//! one span per attempt, beneath the execution beneath the request; and the `traceparent` each
//! attempt sent the upstream names that attempt's span.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::common::process::{await_until, node_config, Node};
use crate::common::{Backend, Db, Reply, TestConfig, Upstream};

/// What an OTLP/HTTP collector got: every span, and the `service.name` of each batch, with the
/// other resource attributes and the headers each export came with.
#[derive(Default)]
struct Received {
    spans: Vec<Span>,
    services: Vec<String>,
    resource: HashMap<String, String>,
    headers: Vec<axum::http::HeaderMap>,
}

/// A collector on 127.0.0.1 that decodes each `POST /v1/traces`.
async fn collector() -> (String, Arc<Mutex<Received>>) {
    let received = Arc::new(Mutex::new(Received::default()));
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(
                |State(received): State<Arc<Mutex<Received>>>, headers: axum::http::HeaderMap, body: Bytes| async move {
                    let batch = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export in protobuf");
                    let mut received = received.lock().unwrap();
                    received.headers.push(headers);
                    for resource in batch.resource_spans {
                        for a in resource.resource.iter().flat_map(|r| &r.attributes) {
                            if let Some(Any::StringValue(v)) = a.value.as_ref().and_then(|v| v.value.as_ref()) {
                                received.resource.insert(a.key.clone(), v.clone());
                            }
                        }
                        let service = resource
                            .resource
                            .iter()
                            .flat_map(|r| &r.attributes)
                            .find(|a| a.key == "service.name")
                            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                                Any::StringValue(name) => Some(name.clone()),
                                _ => None,
                            });
                        received.services.extend(service);
                        received.spans.extend(resource.scope_spans.into_iter().flat_map(|s| s.spans));
                    }
                    axum::http::StatusCode::OK
                },
            ),
        )
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, received)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A span's attribute, as text.
fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span.attributes.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(match value {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::BoolValue(b) => b.to_string(),
        Any::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_one_trace_with_a_span_per_attempt_and_the_clients_trace_is_kept() {
    let (endpoint, received) = collector().await;
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = TestConfig::new(&upstream.url())
        .tables("[routes.retry]\nbase = \"10ms\"\ncap = \"20ms\"\nnot_processed = [503]")
        .tables(&format!("[telemetry]\notlp_endpoint = \"{endpoint}\"\nservice_name = \"idem-under-test\""));
    let mut node = Node::start("traced", &node_config(&db.url, config).body()).await;

    let (client_trace, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    upstream.script("traced", vec![Reply::status(503), Reply::status(201)]);
    let traced = node
        .post("/payments", "traced", "{}")
        .header("traceparent", format!("00-{client_trace}-{client_span}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(traced.status(), 201);
    let untraced = node.post("/payments", "untraced", "{}").send().await.unwrap();
    assert_eq!(untraced.status(), 201);
    // A graceful exit sends the last batch.
    node.terminate();
    assert!(node.wait_exit(Duration::from_secs(20)).await.is_some_and(|s| s.success()), "{}", node.log_tail(30));
    await_until("the spans to reach the collector", Duration::from_secs(5), || {
        received.lock().unwrap().spans.iter().filter(|s| s.name == "attempt").count() >= 3
    })
    .await;

    let received = received.lock().unwrap();
    assert!(received.services.iter().all(|s| s == "idem-under-test") && !received.services.is_empty());
    let mut traces: HashMap<String, Vec<&Span>> = HashMap::new();
    for span in &received.spans {
        traces.entry(hex(&span.trace_id)).or_default().push(span);
    }
    // The traced request: the client's trace, its span the request's parent.
    let spans = traces.get(client_trace).unwrap_or_else(|| panic!("no span in the client's trace: {traces:#?}"));
    let named = |name: &str| spans.iter().filter(|s| s.name == name).copied().collect::<Vec<_>>();
    let (request, execution, attempts) = (named("request"), named("execution"), named("attempt"));
    assert_eq!((request.len(), execution.len(), attempts.len()), (1, 1, 2), "{spans:#?}");
    assert_eq!(hex(&request[0].parent_span_id), client_span, "the request continues the client's span");
    assert_eq!(execution[0].parent_span_id, request[0].span_id, "the execution is the request's child");
    let mut attempts = attempts;
    attempts.sort_by_key(|s| attribute(s, "number"));
    for (attempt, (number, status)) in attempts.iter().zip([("1", "503"), ("2", "201")]) {
        assert_eq!(attempt.parent_span_id, execution[0].span_id, "an attempt is the execution's child");
        assert_eq!(attribute(attempt, "number").as_deref(), Some(number));
        assert_eq!(attribute(attempt, "status").as_deref(), Some(status));
        assert!(attribute(attempt, "class").is_some(), "{attempt:#?}");
    }
    assert_eq!(attribute(attempts[1], "class").as_deref(), Some("success"));
    // Each attempt told the upstream its own span, in the client's trace.
    let sent: Vec<String> = upstream
        .every_headers("traced")
        .iter()
        .map(|h| h.get("traceparent").expect("an attempt without a traceparent").to_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = attempts.iter().map(|a| format!("00-{client_trace}-{}-01", hex(&a.span_id))).collect();
    assert_eq!(sent, expected);

    // The untraced request: a trace of its own, the same shape.
    let others: Vec<&Vec<&Span>> =
        traces.iter().filter(|(id, _)| id.as_str() != client_trace).map(|(_, s)| s).collect();
    let [other] = others.as_slice() else { panic!("not one other trace: {others:#?}") };
    let mut names: Vec<&str> = other.iter().map(|s| s.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["attempt", "execution", "request"]);
    let root = other.iter().find(|s| s.name == "request").unwrap();
    assert!(root.parent_span_id.is_empty(), "a request without a traceparent starts its trace");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampling_ratio_of_zero_exports_no_new_trace_but_keeps_a_clients_sampled_one() {
    let (endpoint, received) = collector().await;
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    let config = TestConfig::new(&upstream.url())
        .tables(&format!("[telemetry]\notlp_endpoint = \"{endpoint}\"\nsampling_ratio = 0.0"));
    let mut node = Node::start("sampled", &node_config(&db.url, config).body()).await;
    let client_trace = "0af7651916cd43dd8448eb211c80319c";
    let sampled = node
        .post("/payments", "sampled", "{}")
        .header("traceparent", format!("00-{client_trace}-b7ad6b7169203331-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(sampled.status(), 201);
    assert_eq!(node.post("/payments", "not-sampled", "{}").send().await.unwrap().status(), 201);
    node.terminate();
    assert!(node.wait_exit(Duration::from_secs(20)).await.is_some(), "{}", node.log_tail(30));
    await_until("the spans to reach the collector", Duration::from_secs(5), || {
        received.lock().unwrap().spans.iter().any(|s| s.name == "attempt")
    })
    .await;
    let received = received.lock().unwrap();
    let traces: std::collections::BTreeSet<String> = received.spans.iter().map(|s| hex(&s.trace_id)).collect();
    assert_eq!(traces.into_iter().collect::<Vec<_>>(), [client_trace]);
    // Not sampled, the untraced request still tells the upstream nothing it would follow.
    let sent = upstream.headers("not-sampled").unwrap();
    assert!(sent.get("traceparent").is_none_or(|v| v.to_str().unwrap().ends_with("-00")), "{sent:?}");
}

/// With no `[telemetry]` in the file, OpenTelemetry's own environment variables send the spans:
/// the endpoint, the headers (a collector's token), the service's name. The resource says the
/// version and the instance; the request's span is a SERVER span and each attempt's a CLIENT
/// span, with the HTTP attributes a trace backend reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opentelemetry_environment_sends_spans_of_the_standard_kinds_and_attributes() {
    let (endpoint, received) = collector().await;
    let upstream = Upstream::start().await;
    let db = Db::new(Backend::Sqlite).await;
    upstream.script("env-traced", vec![Reply::status(503), Reply::status(201)]);
    let config = TestConfig::new(&upstream.url()).tables("[routes.retry]\nbase = \"10ms\"\n");
    let env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".to_string(), endpoint),
        ("OTEL_EXPORTER_OTLP_HEADERS".to_string(), "authorization=Bearer%20collector-token".to_string()),
        ("OTEL_SERVICE_NAME".to_string(), "payments-gateway".to_string()),
        ("OTEL_TRACES_SAMPLER".to_string(), "parentbased_always_on".to_string()),
    ];
    let mut node = Node::start_with_env("env-traced", &node_config(&db.url, config).body(), env).await;
    let answer = node.post("/payments", "env-traced", r#"{"amount":1}"#).send().await.unwrap();
    assert_eq!(answer.status(), 201);
    node.terminate();
    node.wait_exit(Duration::from_secs(15)).await;
    await_until("the spans exported", Duration::from_secs(10), || received.lock().unwrap().spans.len() >= 4).await;

    let received = received.lock().unwrap();
    assert!(received.services.iter().all(|s| s == "payments-gateway"), "{:?}", received.services);
    assert_eq!(received.resource.get("service.version").map(String::as_str), Some(env!("CARGO_PKG_VERSION")));
    assert!(received.resource.get("service.instance.id").is_some_and(|id| id.len() == 36), "{:?}", received.resource);
    assert!(received.headers.iter().all(|h| h["authorization"] == "Bearer collector-token"));
    // OTLP's span kinds: 2 is SERVER, 3 is CLIENT.
    let request = received.spans.iter().find(|s| s.name == "request").expect("the request's span");
    assert_eq!(request.kind, 2);
    assert_eq!(attribute(request, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(attribute(request, "url.path").as_deref(), Some("/payments"));
    assert_eq!(attribute(request, "http.response.status_code").as_deref(), Some("201"));
    let mut attempts: Vec<&Span> = received.spans.iter().filter(|s| s.name == "attempt").collect();
    attempts.sort_by_key(|s| attribute(s, "http.request.resend_count"));
    assert_eq!(attempts.len(), 2);
    for (n, (attempt, status)) in attempts.iter().zip(["503", "201"]).enumerate() {
        assert_eq!(attempt.kind, 3);
        assert_eq!(attribute(attempt, "http.response.status_code").as_deref(), Some(status));
        assert_eq!(attribute(attempt, "http.request.resend_count"), Some(n.to_string()));
        assert_eq!(attribute(attempt, "server.address").as_deref(), Some("127.0.0.1"));
    }
}
