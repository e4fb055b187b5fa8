//! Micro-benchmarks of the hot path's pure steps: key parsing and fingerprinting, with hashing
//! the raw bytes alone as the baseline each fingerprint is compared with.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use idem::fingerprint::Fingerprint;
use idem::key::IdempotencyKey;
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

criterion_group!(benches, keys, fingerprints);
criterion_main!(benches);
