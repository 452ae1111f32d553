//! What sealing records costs per request: the key derivation every covered request does
//! (store name and record key), sealing a record with a 1 KiB body (every completion) and
//! opening it (every replay), each against the same work without cryptography.
//!
//! ```sh
//! cargo bench --bench record --features internals
//! ```
//!
//! Goal (issue 12): encryption adds less than 1 µs per request for a 1 KiB record. The ratios
//! in `docs/BENCHMARKS.md` come from `benches/lock.rs`-style rounds; here criterion reports the
//! time per operation, and the difference "sealed minus plain" is what encryption adds.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use http::HeaderMap;
use tower_idempotency::internals;

fn headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("content-type", "application/json".parse().unwrap());
    h.insert("location", "/payments/pay_1234567890".parse().unwrap());
    h
}

fn records(c: &mut Criterion) {
    let keys = internals::keys(b"bench secret: 32 bytes, not real");
    let parts = http::Request::post("/payments")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let (record_key, name) =
        internals::derive(&keys, &parts, "8e03978e-40d5-43e8-bc93-6894a57f9324");
    let body = vec![b'x'; 1024];
    let headers = headers();
    let sealed = internals::seal(&record_key, &name, &body, &headers);
    let plain = internals::encode_plain(&body, &headers);

    let mut g = c.benchmark_group("record 1 KiB");
    g.bench_function("derive name and record key (per request)", |b| {
        b.iter(|| internals::derive(&keys, black_box(&parts), black_box("8e03978e-40d5")))
    });
    g.bench_function("encode (plain)", |b| {
        b.iter(|| internals::encode_plain(black_box(&body), &headers))
    });
    g.bench_function("encode + seal", |b| {
        b.iter(|| internals::seal(&record_key, &name, black_box(&body), &headers))
    });
    g.bench_function("decode (plain)", |b| {
        b.iter(|| internals::decode_plain(black_box(&plain)))
    });
    g.bench_function("open + decode", |b| {
        b.iter(|| internals::open(&record_key, &name, black_box(&sealed)))
    });
    g.finish();

    // A replay opens a streamed record's 64 KiB parts; one read from Redis arrives in a buffer
    // of its own (set up outside the timing, as the network read is not the replay's work).
    let data = vec![b'x'; 64 * 1024];
    let chunk = internals::seal_chunk(&record_key, &name, &data);
    let mut g = c.benchmark_group("replay, one 64 KiB part");
    for (label, copy) in [
        ("opened where it lies", false),
        ("copied, then opened", true),
    ] {
        g.bench_function(label, |b| {
            b.iter_batched(
                || bytes::Bytes::from(chunk.clone()),
                |sealed| internals::open_chunk(&record_key, &name, sealed, copy),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, records);
criterion_main!(benches);
