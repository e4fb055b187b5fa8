//! Micro-benchmarks of the hot path's pure steps: key parsing and fingerprinting, with hashing
//! the raw bytes alone as the baseline each fingerprint is compared with; and a replay's answer,
//! with building it from the stored headers, as replays once did, as its baseline.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use idem::domain::fingerprint::Fingerprint;
use idem::domain::key::IdempotencyKey;
use idem::domain::{RecordId, RouteName, Timestamp};
use idem::record::StoredResponse;
use idem::test_support::{Replay, EXPIRES_HEADER, REPLAYED_HEADER};
use idem::test_support::{SHOULD_RETRY_HEADER, STATUS_HEADER};
use sha2::{Digest, Sha256};

fn json_body(approx_bytes: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut size = 0;
    let mut i = 0;
    while size < approx_bytes {
        let item = format!(
            r#"{{"sku":"item-{i}","quantity":{q},"price":{{"amount":{a},"currency":"eur"}},"tags":["a","b"]}}"#,
            q = i % 7 + 1,
            a = 1000 + i * 13
        );
        size += item.len() + 1;
        items.push(item);
        i += 1;
    }
    format!(r#"{{"customer":"cus_123","items":[{}],"note":"leave at the door"}}"#, items.join(",")).into_bytes()
}

fn keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("key_parse");
    g.bench_function("bare_uuid", |b| {
        b.iter(|| IdempotencyKey::parse_header(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")))
    });
    g.bench_function("sf_string_uuid", |b| {
        b.iter(|| IdempotencyKey::parse_header(black_box(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")))
    });
    g.finish();
}

fn fingerprints(c: &mut Criterion) {
    let mut g = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024] {
        let body = json_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("sha256_raw_baseline", size), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(body)))
        });
        g.bench_with_input(BenchmarkId::new("json_canonical", size), &body, |b, body| {
            b.iter(|| Fingerprint::of("payments", "POST", "/payments", "", Some(b"application/json"), black_box(body)))
        });
        g.bench_with_input(BenchmarkId::new("non_json_bytes", size), &body, |b, body| {
            b.iter(|| Fingerprint::of("payments", "POST", "/payments", "", Some(b"text/plain"), black_box(body)))
        });
    }
    g.finish();
}

/// A typical upstream's answer: five headers and a small JSON body.
fn stored_answer() -> StoredResponse {
    let headers = [
        ("content-type", "application/json"),
        ("date", "Wed, 02 Dec 2026 22:40:00 GMT"),
        ("server", "nginx"),
        ("x-request-id", "req_8e03978e40d543e8bc936894a57f9324"),
        ("cache-control", "no-store"),
    ];
    StoredResponse {
        status: 201,
        headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
        body: bytes::Bytes::from_static(br#"{"id":"ch_1","ok":true}"#),
    }
}

fn replay_answers(c: &mut Criterion) {
    let stored = stored_answer();
    let expires_at = Timestamp::now();
    let mut g = c.benchmark_group("replay_answer");
    // How replays built their answer before it was kept prebuilt, frozen here as the baseline:
    // each stored header parsed and checked, the marks added, the expiry formatted.
    g.bench_function("parsed_each_time_baseline", |b| {
        b.iter(|| {
            let stored = black_box(&stored);
            let mut response = Response::new(Body::from(stored.body.clone()));
            *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
            *response.headers_mut() = idem::test_support::to_header_map(&stored.headers);
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static("done"));
            headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
            headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            let date = httpdate::fmt_http_date(expires_at.system_time());
            headers.insert(EXPIRES_HEADER, HeaderValue::from_str(&date).expect("an HTTP date"));
            response
        })
    });
    let fingerprint = Fingerprint::of("payments", "POST", "/payments", "", None, b"{}");
    let replay =
        Replay::new(RecordId(uuid::Uuid::nil()), fingerprint, RouteName::from("payments"), &stored, expires_at);
    g.bench_function("prebuilt", |b| b.iter(|| black_box(&replay).answer()));
    g.finish();
}

criterion_group!(benches, keys, fingerprints, replay_answers);
criterion_main!(benches);
