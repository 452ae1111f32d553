//! Lock benchmarks, every variant against the same Redis in the same run, reported as ratios.
//!
//! ```sh
//! cargo bench --bench lock                    # 5 rounds of 2 s per variant
//! BENCH_ROUNDS=9 cargo bench --bench lock     # more rounds
//! ```
//!
//! 1. Uncontended acquire + release, sequential on one connection, and 64 tasks on distinct keys
//!    sharing one multiplexed connection: ours, the `rslock` crate, and the limit: the raw
//!    command pair a lock needs (`SET NX PX`, then `EVALSHA` compare-and-delete) sent with the
//!    plain redis client.
//! 2. Contention: 64 tasks on one key; critical sections per second, p99 wait, and Redis
//!    commands sent per critical section (counted with `MONITOR`, script-internal calls excluded).
//! 3. Redlock on 3 masters against one: acquire + release latency.
//!
//! Under `cargo test` (no `--bench` argument) every variant runs once, briefly.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::ops::{
    AltScripts, Alternative, Release, UNLOCK, alternative_pair, ours_pair, process_cpu, raw_pair,
    rslock_pair, scripts_pair,
};
use common::{Mode, Series, percentile_us, row};
use distlock::{LockClient, LockConfig};
use futures_util::StreamExt;
use testkit::RedisServer;

const TASKS: usize = 64;

/// The ways of sending a fenced acquire + release compared in section 1's alternatives table,
/// each sent with the plain client by 64 tasks on distinct keys.
const ALTERNATIVES: [(&str, Alternative, Release); 9] = [
    (
        "Lua script + release with PUBLISH (before)",
        Alternative::Script,
        Release::Publish,
    ),
    (
        "smallest Lua script + release with PUBLISH",
        Alternative::SmallScript,
        Release::Publish,
    ),
    (
        "Redis 7 function (FCALL) for both",
        Alternative::Function,
        Release::Publish,
    ),
    (
        "MULTI/EXEC HINCRBY + SET NX PX + release with PUBLISH",
        Alternative::Multi,
        Release::Publish,
    ),
    (
        "pipelined HINCRBY + SET NX PX, no MULTI (unsafe) + release with PUBLISH",
        Alternative::Pipeline,
        Release::Publish,
    ),
    (
        "pipelined SET NX PX, then HINCRBY, no MULTI (safe: what the crate sends) + release FCALL",
        Alternative::SetThenFence,
        Release::Publish,
    ),
    (
        "Lua script + release without PUBLISH",
        Alternative::Script,
        Release::Plain,
    ),
    (
        "MULTI/EXEC + release publishing only when a waiter marked the lock",
        Alternative::Multi,
        Release::PublishIfMarked,
    ),
    (
        "MULTI/EXEC + release without PUBLISH",
        Alternative::Multi,
        Release::Plain,
    ),
];

/// Operations per second of `op`, run back to back for `window` after a warm-up.
async fn sequential<F, Fut>(mode: Mode, mut op: F) -> f64
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let warm = Instant::now();
    while warm.elapsed() < mode.warmup {
        op().await;
    }
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < mode.window {
        op().await;
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// What one concurrent window measured.
#[derive(Debug, Clone, Copy)]
struct Measured {
    ops_per_s: f64,
    /// CPU time of `redis-server` per operation, µs.
    server_us: f64,
    /// CPU time of this process (the client) per operation, µs.
    client_us: f64,
}

/// Total operations per second of `TASKS` tasks running `make(i)` in loops, and the CPU time
/// the server (`pid`) and this process spent per operation meanwhile.
async fn concurrent<F, Fut>(mode: Mode, pid: u32, make: F) -> Measured
where
    F: Fn(usize) -> Box<dyn FnMut() -> Fut + Send>,
    Fut: Future<Output = ()> + Send + 'static,
{
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let measure_from = start + mode.warmup;
    let end = measure_from + mode.window;
    let mut tasks = Vec::new();
    for i in 0..TASKS {
        let mut op = make(i);
        let count = count.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                op().await;
                if now >= measure_from {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let pid = pid.to_string();
    tokio::time::sleep_until(measure_from.into()).await;
    let (server0, client0) = (process_cpu(&pid), process_cpu("self"));
    tokio::time::sleep_until(end.into()).await;
    let (server1, client1) = (process_cpu(&pid), process_cpu("self"));
    for t in tasks {
        t.await.unwrap();
    }
    let ops = count.load(Ordering::Relaxed) as f64;
    let per_op = |d: Duration| d.as_secs_f64() * 1e6 / ops.max(1.0);
    Measured {
        ops_per_s: ops / mode.window.as_secs_f64(),
        server_us: per_op(server1 - server0),
        client_us: per_op(client1 - client0),
    }
}

/// The figures of one concurrent variant over the rounds.
#[derive(Debug, Clone, Default)]
struct Con {
    ops: Series,
    server_us: Series,
    client_us: Series,
}

impl Con {
    fn push(&mut self, m: Measured) {
        self.ops.push(m.ops_per_s);
        self.server_us.push(m.server_us);
        self.client_us.push(m.client_us);
    }

    /// "server µs + client µs" CPU per operation, medians.
    fn cpu(&self) -> String {
        format!(
            "{:.1} + {:.1}",
            self.server_us.median(),
            self.client_us.median()
        )
    }
}

/// Client requests seen by `MONITOR` while `work` runs (commands issued by scripts excluded).
async fn count_commands<T, Fut: Future<Output = T>>(server: &RedisServer, work: Fut) -> (u64, T) {
    let monitor = server.client().get_async_monitor().await.unwrap();
    let counted = Arc::new(AtomicU64::new(0));
    let counter = {
        let counted = counted.clone();
        tokio::spawn(async move {
            let mut stream = monitor.into_on_message::<String>();
            while let Some(line) = stream.next().await {
                if !line.contains(" lua]") && !line.contains("\"MONITOR\"") {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let out = work.await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    counter.abort();
    (counted.load(Ordering::Relaxed), out)
}

/// Figures of one contention window.
#[derive(Default)]
struct Contention {
    sections_per_s: Series,
    p99_wait_us: Series,
    commands_per_section: Series,
}

impl Contention {
    /// 64 tasks take one lock in turn for `window`, each looping on `acquire_release`; the
    /// commands the server receives meanwhile are counted.
    async fn round<F, Fut>(&mut self, server: &RedisServer, window: Duration, acquire_release: F)
    where
        F: Fn() -> Fut + Clone + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let (commands, mut waits) = count_commands(server, async {
            let end = Instant::now() + window;
            let mut tasks = Vec::new();
            for _ in 0..TASKS {
                let f = acquire_release.clone();
                tasks.push(tokio::spawn(async move {
                    let mut waits = Vec::new();
                    while Instant::now() < end {
                        let t = Instant::now();
                        f().await;
                        waits.push(t.elapsed());
                    }
                    waits
                }));
            }
            let mut waits = Vec::new();
            for t in tasks {
                waits.extend(t.await.unwrap());
            }
            waits
        })
        .await;
        let sections = waits.len() as f64;
        self.sections_per_s.push(sections / window.as_secs_f64());
        self.p99_wait_us.push(percentile_us(&mut waits, 99.0));
        self.commands_per_section
            .push(commands as f64 / sections.max(1.0));
    }
}

fn main() {
    let mode = Mode::from_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(mode));
}

async fn run(mode: Mode) {
    let server = RedisServer::start_owned().await;
    let masters = RedisServer::start_many(3).await;
    let url = server.url();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let script = redis::Script::new(UNLOCK);
    let acquire_lua = redis::Script::new(include_str!(
        "../crates/distlock/src/backend/redis/scripts/acquire.lua"
    ));
    let release_lua = redis::Script::new(include_str!(
        "../crates/distlock/src/backend/redis/scripts/release.lua"
    ));
    let ours = LockClient::builder()
        .prefix("bench")
        .unwrap()
        .redis(conn.clone())
        .unwrap();
    ours.prepare().await.unwrap();
    let ours_notified = LockClient::builder()
        .prefix("bench")
        .unwrap()
        .connect(&url)
        .unwrap();
    ours_notified.prepare().await.unwrap();
    let rs1 = rslock::LockManager::new(vec![url.clone()]);
    let rs3 = rslock::LockManager::new(urls.clone());
    let ours3 = LockClient::builder()
        .prefix("bench")
        .unwrap()
        .connect_redlock(&urls)
        .unwrap();
    ours3.prepare().await.unwrap();
    let single = ours.lock("seq").unwrap();
    let unfenced_client = ours
        .with_config(LockConfig::builder().fencing(false).build().unwrap())
        .unwrap();
    let unfenced = unfenced_client.lock("seq-unfenced").unwrap();
    let unfenced3 = ours3
        .with_config(LockConfig::builder().fencing(false).build().unwrap())
        .unwrap()
        .lock("seq-unfenced")
        .unwrap();
    let triple = ours3.lock("seq").unwrap();
    let alt_scripts = AltScripts::load(&mut conn.clone()).await;
    let mut alternatives: Vec<Con> = vec![Con::default(); ALTERNATIVES.len()];
    let pid = server.pid().expect("the bench starts its own redis-server");

    let (mut raw_seq, mut ours_seq, mut rs_seq) =
        (Series::default(), Series::default(), Series::default());
    let (mut scripts_seq, mut scripts_con) = (Series::default(), Con::default());
    let (mut unf_seq, mut unf_con, mut unf_rl) =
        (Series::default(), Con::default(), Series::default());
    let (mut raw_con, mut ours_con, mut rs_con) = (Con::default(), Con::default(), Con::default());
    let (mut ours_rl, mut rs_rl) = (Series::default(), Series::default());
    // For profiling: `BENCH_PROFILE=<text>` runs only the alternatives whose label contains it,
    // for `BENCH_WINDOW_MS` each, and prints nothing else.
    if let Ok(filter) = std::env::var("BENCH_PROFILE") {
        for (label, acquire, release) in ALTERNATIVES {
            if label.contains(&filter) {
                let m = concurrent(mode, pid, |i| {
                    let (conn, scripts) = (conn.clone(), alt_scripts.clone());
                    let key = format!("alt:{i}");
                    Box::new(move || {
                        let (mut c, s, k) = (conn.clone(), scripts.clone(), key.clone());
                        async move { alternative_pair(&mut c, &s, acquire, release, &k).await }
                    })
                })
                .await;
                println!("{label}: {m:?}");
            }
        }
        return;
    }
    for round in 0..mode.rounds {
        eprintln!("round {}/{}", round + 1, mode.rounds);
        let mut c = conn.clone();
        raw_seq.push(
            sequential(mode, || {
                let (mut c, s) = (c.clone(), &script);
                async move { raw_pair(&mut c, s, "raw:seq", "token").await }
            })
            .await,
        );
        let _ = &mut c;
        scripts_seq.push(
            sequential(mode, || {
                let (mut c, a, r) = (conn.clone(), &acquire_lua, &release_lua);
                async move { scripts_pair(&mut c, a, r, "scripts:seq").await }
            })
            .await,
        );
        ours_seq.push(sequential(mode, || ours_pair(&single)).await);
        rs_seq.push(sequential(mode, || rslock_pair(&rs1, "rs:seq")).await);
        ours_rl.push(sequential(mode, || ours_pair(&triple)).await);
        unf_seq.push(sequential(mode, || ours_pair(&unfenced)).await);
        unf_rl.push(sequential(mode, || ours_pair(&unfenced3)).await);
        rs_rl.push(sequential(mode, || rslock_pair(&rs3, "rs3:seq")).await);

        raw_con.push(
            concurrent(mode, pid, |i| {
                let (conn, script) = (conn.clone(), script.clone());
                let key = format!("raw:{i}");
                Box::new(move || {
                    let (mut c, s, k) = (conn.clone(), script.clone(), key.clone());
                    async move { raw_pair(&mut c, &s, &k, "token").await }
                })
            })
            .await,
        );
        scripts_con.push(
            concurrent(mode, pid, |i| {
                let (conn, a, r) = (conn.clone(), acquire_lua.clone(), release_lua.clone());
                let key = format!("scripts:{i}");
                Box::new(move || {
                    let (mut c, a, r, k) = (conn.clone(), a.clone(), r.clone(), key.clone());
                    async move { scripts_pair(&mut c, &a, &r, &k).await }
                })
            })
            .await,
        );
        ours_con.push(
            concurrent(mode, pid, |i| {
                let lock = ours.lock(&format!("con{i}")).unwrap();
                Box::new(move || {
                    let lock = lock.clone();
                    async move { ours_pair(&lock).await }
                })
            })
            .await,
        );
        unf_con.push(
            concurrent(mode, pid, |i| {
                let lock = unfenced_client.lock(&format!("unf{i}")).unwrap();
                Box::new(move || {
                    let lock = lock.clone();
                    async move { ours_pair(&lock).await }
                })
            })
            .await,
        );
        for (series, (_, acquire, release)) in alternatives.iter_mut().zip(ALTERNATIVES) {
            series.push(
                concurrent(mode, pid, |i| {
                    let (conn, scripts) = (conn.clone(), alt_scripts.clone());
                    let key = format!("alt:{i}");
                    Box::new(move || {
                        let (mut c, s, k) = (conn.clone(), scripts.clone(), key.clone());
                        async move { alternative_pair(&mut c, &s, acquire, release, &k).await }
                    })
                })
                .await,
            );
        }
        rs_con.push(
            concurrent(mode, pid, |i| {
                let manager = rs1.clone();
                let key = format!("rs:{i}");
                Box::new(move || {
                    let (m, k) = (manager.clone(), key.clone());
                    async move { rslock_pair(&m, &k).await }
                })
            })
            .await,
        );
    }

    // Contention, in rounds too: one window each.
    let window = mode.window * 2;
    let hot = ours_notified.lock("hot").unwrap();
    let (mut ours_cont, mut rs_cont) = (Contention::default(), Contention::default());
    for round in 0..mode.rounds {
        eprintln!("contention round {}/{}", round + 1, mode.rounds);
        let lock = hot.clone();
        ours_cont
            .round(&server, window, move || {
                let lock = lock.clone();
                async move {
                    let g = lock.acquire(Duration::from_secs(30)).await.unwrap();
                    g.release().await.unwrap();
                }
            })
            .await;
        let manager = rs1.clone();
        rs_cont
            .round(&server, window, move || {
                let manager = manager.clone();
                async move {
                    let guard = manager
                        .acquire(b"rs:hot".as_slice(), Duration::from_secs(10))
                        .await
                        .unwrap();
                    guard.release().await;
                }
            })
            .await;
    }

    println!(
        "\n## Lock ({} rounds × {:?} per variant; {})\n",
        mode.rounds,
        mode.window,
        common::machine()
    );
    row(&["figure", "ours", "reference", "ratio min / median / max"]);
    row(&["---", "---", "---", "---"]);
    let ops = |s: &Series| s.fmt_abs("ops/s");
    row(&[
        "uncontended, sequential: ours / raw limit",
        &ops(&ours_seq),
        &ops(&raw_seq),
        &ours_seq.ratio(&raw_seq).fmt_ratio(),
    ]);
    row(&[
        "uncontended, sequential: ours / rslock",
        &ops(&ours_seq),
        &ops(&rs_seq),
        &ours_seq.ratio(&rs_seq).fmt_ratio(),
    ]);
    row(&[
        "uncontended, sequential: our scripts sent raw / raw limit (server-side cost)",
        &ops(&scripts_seq),
        &ops(&raw_seq),
        &scripts_seq.ratio(&raw_seq).fmt_ratio(),
    ]);
    row(&[
        "uncontended, sequential: ours / our scripts sent raw (client-side cost)",
        &ops(&ours_seq),
        &ops(&scripts_seq),
        &ours_seq.ratio(&scripts_seq).fmt_ratio(),
    ]);
    row(&[
        "uncontended, 64 tasks: our scripts sent raw / raw limit",
        &ops(&scripts_con.ops),
        &ops(&raw_con.ops),
        &scripts_con.ops.ratio(&raw_con.ops).fmt_ratio(),
    ]);
    row(&[
        "uncontended, 64 tasks: ours / our scripts sent raw",
        &ops(&ours_con.ops),
        &ops(&scripts_con.ops),
        &ours_con.ops.ratio(&scripts_con.ops).fmt_ratio(),
    ]);
    row(&[
        "uncontended, 64 tasks: ours / raw limit",
        &ops(&ours_con.ops),
        &ops(&raw_con.ops),
        &ours_con.ops.ratio(&raw_con.ops).fmt_ratio(),
    ]);
    row(&[
        "uncontended, 64 tasks: ours / rslock",
        &ops(&ours_con.ops),
        &ops(&rs_con.ops),
        &ours_con.ops.ratio(&rs_con.ops).fmt_ratio(),
    ]);
    let latency = |s: &Series| Series(s.0.iter().map(|ops| 1e6 / ops).collect());
    row(&[
        "Redlock 3 masters / 1, latency: ours",
        &format!("{:.0} µs", latency(&ours_rl).median()),
        &format!("{:.0} µs", latency(&ours_seq).median()),
        &latency(&ours_rl).ratio(&latency(&ours_seq)).fmt_ratio(),
    ]);
    row(&[
        "Redlock 3 masters / 1, latency: rslock",
        &format!("{:.0} µs", latency(&rs_rl).median()),
        &format!("{:.0} µs", latency(&rs_seq).median()),
        &latency(&rs_rl).ratio(&latency(&rs_seq)).fmt_ratio(),
    ]);
    row(&[
        "Redlock 3 masters, latency: ours / rslock",
        "",
        "",
        &latency(&ours_rl).ratio(&latency(&rs_rl)).fmt_ratio(),
    ]);
    row(&[
        "fencing off: uncontended, sequential: ours / raw limit",
        &ops(&unf_seq),
        &ops(&raw_seq),
        &unf_seq.ratio(&raw_seq).fmt_ratio(),
    ]);
    row(&[
        "fencing off: uncontended, 64 tasks: ours / raw limit",
        &ops(&unf_con.ops),
        &ops(&raw_con.ops),
        &unf_con.ops.ratio(&raw_con.ops).fmt_ratio(),
    ]);
    row(&[
        "fencing off: uncontended, 64 tasks: ours / rslock",
        &ops(&unf_con.ops),
        &ops(&rs_con.ops),
        &unf_con.ops.ratio(&rs_con.ops).fmt_ratio(),
    ]);
    row(&[
        "fencing off: Redlock 3 masters / 1, latency: ours",
        &format!("{:.0} µs", latency(&unf_rl).median()),
        &format!("{:.0} µs", latency(&unf_seq).median()),
        &latency(&unf_rl).ratio(&latency(&unf_seq)).fmt_ratio(),
    ]);
    row(&[
        "fencing off: Redlock 3 masters, latency: ours / rslock",
        "",
        "",
        &latency(&unf_rl).ratio(&latency(&rs_rl)).fmt_ratio(),
    ]);
    println!(
        "\n### Fenced acquire + release, sent with the plain client, {TASKS} tasks on distinct keys\n"
    );
    row(&[
        "way",
        "ops/s",
        "CPU µs per pair: server + client",
        "/ the Lua script as it was",
        "/ raw limit",
        "/ rslock",
    ]);
    row(&["---", "---", "---", "---", "---", "---"]);
    let references = [
        (
            "(reference) raw limit: SET NX PX + compare-and-delete, unfenced",
            &raw_con,
        ),
        ("(reference) rslock, unfenced", &rs_con),
        ("(reference) ours, the crate, fenced", &ours_con),
        ("(reference) ours, the crate, fencing off", &unf_con),
    ];
    let measured = ALTERNATIVES
        .iter()
        .map(|(label, _, _)| *label)
        .zip(&alternatives);
    for (label, series) in measured.chain(references) {
        row(&[
            label,
            &ops(&series.ops),
            &series.cpu(),
            &series.ops.ratio(&alternatives[0].ops).fmt_ratio(),
            &series.ops.ratio(&raw_con.ops).fmt_ratio(),
            &series.ops.ratio(&rs_con.ops).fmt_ratio(),
        ]);
    }
    println!("\n### Contention: {TASKS} tasks on one key, {window:?} per round\n");
    row(&[
        "figure",
        "ours",
        "rslock",
        "ours / rslock, min / median / max",
    ]);
    row(&["---", "---", "---", "---"]);
    for (name, unit, ours, theirs) in [
        (
            "critical sections per second",
            "/s",
            &ours_cont.sections_per_s,
            &rs_cont.sections_per_s,
        ),
        (
            "p99 wait",
            "µs",
            &ours_cont.p99_wait_us,
            &rs_cont.p99_wait_us,
        ),
    ] {
        row(&[
            name,
            &ours.fmt_abs(unit),
            &theirs.fmt_abs(unit),
            &ours.ratio(theirs).fmt_ratio(),
        ]);
    }
    let (ours, theirs) = (
        &ours_cont.commands_per_section,
        &rs_cont.commands_per_section,
    );
    row(&[
        "Redis commands per critical section",
        &format!(
            "{:.2} (min {:.2}, max {:.2})",
            ours.median(),
            ours.min(),
            ours.max()
        ),
        &format!(
            "{:.2} (min {:.2}, max {:.2})",
            theirs.median(),
            theirs.min(),
            theirs.max()
        ),
        &ours.ratio(theirs).fmt_ratio(),
    ]);
}
