//! Criterion benchmarks of one uncontended acquire + release, for each way the lock benchmarks
//! compare: the raw command pair (the limit), ours (fenced and unfenced), and the `rslock`
//! crate; sequential on one connection, 64 tasks on distinct keys sharing one multiplexed
//! connection, and Redlock on 3 masters against one.
//!
//! ```sh
//! cargo bench --bench acquire                 # criterion: time per acquire + release
//! cargo bench --bench acquire -- sequential   # one group
//! ```
//!
//! Criterion times each variant on its own, one after another; `benches/lock.rs` interleaves
//! them in rounds and reports ratios, which on a shared machine is the steadier figure.
//! `docs/BENCHMARKS.md` puts both side by side. Under `cargo test` each variant runs once.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::ops::{UNLOCK, ours_pair, raw_pair, rslock_pair};
use criterion::{Criterion, criterion_group, criterion_main};
use distlock::{LockClient, LockConfig};
use testkit::RedisServer;
use tokio::runtime::Runtime;

const TASKS: u64 = 64;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The time `TASKS` tasks take to run `iters` operations between them, each task looping on
/// its own operation from `make(task)`.
async fn spread<F, Fut>(iters: u64, make: F) -> Duration
where
    F: Fn(u64) -> Box<dyn FnMut() -> Fut + Send>,
    Fut: Future<Output = ()> + Send + 'static,
{
    let per_task = iters.div_ceil(TASKS);
    let ops: Vec<_> = (0..TASKS).map(make).collect();
    let start = Instant::now();
    let tasks: Vec<_> = ops
        .into_iter()
        .map(|mut op| {
            tokio::spawn(async move {
                for _ in 0..per_task {
                    op().await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // Scale to exactly `iters` operations.
    start
        .elapsed()
        .mul_f64(iters as f64 / (per_task * TASKS) as f64)
}

fn uncontended(c: &mut Criterion) {
    let rt = runtime();
    let _entered = rt.enter();
    let server = rt.block_on(RedisServer::start_owned());
    let masters = rt.block_on(RedisServer::start_many(3));
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let conn = rt
        .block_on(server.client().get_multiplexed_async_connection())
        .unwrap();
    let unlock = redis::Script::new(UNLOCK);
    let ours = LockClient::builder()
        .prefix("crit")
        .unwrap()
        .redis(conn.clone())
        .unwrap();
    let unfenced = ours
        .with_config(LockConfig::builder().fencing(false).build().unwrap())
        .unwrap();
    let ours3 = LockClient::builder()
        .prefix("crit")
        .unwrap()
        .connect_redlock(&urls)
        .unwrap();
    rt.block_on(ours.prepare()).unwrap();
    rt.block_on(ours3.prepare()).unwrap();
    let rs1 = rslock::LockManager::new(vec![server.url()]);
    let rs3 = rslock::LockManager::new(urls.clone());

    let mut group = c.benchmark_group("sequential");
    group.bench_function("raw SET NX PX + EVALSHA (limit)", |b| {
        b.to_async(&rt).iter(|| {
            let mut c = conn.clone();
            let s = &unlock;
            async move { raw_pair(&mut c, s, "raw:seq", "token").await }
        })
    });
    let lock = ours.lock("seq").unwrap();
    group.bench_function("ours", |b| b.to_async(&rt).iter(|| ours_pair(&lock)));
    let lock = unfenced.lock("seq-unfenced").unwrap();
    group.bench_function("ours, fencing off", |b| {
        b.to_async(&rt).iter(|| ours_pair(&lock))
    });
    group.bench_function("rslock", |b| {
        b.to_async(&rt).iter(|| rslock_pair(&rs1, "rs:seq"))
    });
    group.finish();

    let mut group = c.benchmark_group("64 tasks");
    group.bench_function("raw SET NX PX + EVALSHA (limit)", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            spread(iters, |i| {
                let (conn, unlock, key) = (conn.clone(), unlock.clone(), format!("raw:{i}"));
                Box::new(move || {
                    let (mut c, s, k) = (conn.clone(), unlock.clone(), key.clone());
                    async move { raw_pair(&mut c, &s, &k, "token").await }
                })
            })
        })
    });
    for (name, client) in [("ours", &ours), ("ours, fencing off", &unfenced)] {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                spread(iters, |i| {
                    let lock = client.lock(&format!("con{i}")).unwrap();
                    Box::new(move || {
                        let lock = lock.clone();
                        async move { ours_pair(&lock).await }
                    })
                })
            })
        });
    }
    let rs1 = std::sync::Arc::new(rs1);
    group.bench_function("rslock", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            spread(iters, |i| {
                let (rs, key) = (rs1.clone(), format!("rs:{i}"));
                Box::new(move || {
                    let (rs, key) = (rs.clone(), key.clone());
                    async move { rslock_pair(&rs, &key).await }
                })
            })
        })
    });
    group.finish();

    let mut group = c.benchmark_group("redlock 3 masters");
    let lock = ours3.lock("seq").unwrap();
    group.bench_function("ours", |b| b.to_async(&rt).iter(|| ours_pair(&lock)));
    let lock = ours3
        .with_config(LockConfig::builder().fencing(false).build().unwrap())
        .unwrap()
        .lock("seq-unfenced")
        .unwrap();
    group.bench_function("ours, fencing off", |b| {
        b.to_async(&rt).iter(|| ours_pair(&lock))
    });
    group.bench_function("rslock", |b| {
        b.to_async(&rt).iter(|| rslock_pair(&rs3, "rs3:seq"))
    });
    group.finish();
    drop((server, masters));
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = uncontended
}
criterion_main!(benches);
