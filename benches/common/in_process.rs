//! Timing requests made in process, the same way for ours and for a peer: used by
//! benches/layer.rs and by the `idempotent` peer's `--round` mode (benches/peers/idempotent),
//! so that both sides of a ratio are measured by one piece of code.

use std::future::Future;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// The pause before each request of [`after_pause`]: long enough for the CPU to go idle.
pub const PAUSE: Duration = Duration::from_millis(10);

/// Time per request (µs) of `one` over `window`, each call with a key from `key`.
pub async fn per_request<F, Fut>(
    window: Duration,
    mut key: impl FnMut() -> String,
    mut one: F,
) -> f64
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = usize>,
{
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < window {
        for _ in 0..100 {
            black_box(one(key()).await);
        }
        n += 100;
    }
    started.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// Median time (µs) of `n` calls of `one`, each after a [`PAUSE`]: with `sleep`, the thread
/// sleeps and the CPU goes idle (on this VM a halted vCPU, which comes back with cold caches,
/// TLB and predictors), as between the requests of a service at low traffic; without, it spins,
/// so the CPU stays awake and only time passes (timers, the store's expiries). The runtime is
/// blocked during the pause.
pub async fn after_pause<F, Fut>(
    n: usize,
    sleep: bool,
    mut key: impl FnMut() -> String,
    mut one: F,
) -> f64
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = usize>,
{
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let key = key();
        if sleep {
            std::thread::sleep(PAUSE);
        } else {
            let spin = Instant::now();
            while spin.elapsed() < PAUSE {
                std::hint::spin_loop();
            }
        }
        let started = Instant::now();
        black_box(one(key).await);
        samples.push(started.elapsed());
    }
    percentile_us(&mut samples, 50.0)
}

/// The p-th percentile (0..=100) of durations, in microseconds (NaN for none).
pub fn percentile_us(samples: &mut [Duration], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[rank].as_secs_f64() * 1e6
}
