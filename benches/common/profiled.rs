//! A future polled in a function of its own, for tools that measure one function: `valgrind
//! --tool=callgrind --collect-atstart=no --toggle-collect='*::poll_profiled*' --dump-instr=yes`
//! gives the code the request's own future runs (not the tasks it leaves work to:
//! `scripts/footprint.py` counts the whole process for that). Used by benches/layer.rs and by the
//! `idempotent` peer's `--profile` mode (benches/peers/idempotent), so that both count the same
//! span.

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

/// `future`'s output, every poll of it in [`poll_profiled`].
pub async fn profiled<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    std::future::poll_fn(|cx| poll_profiled(future.as_mut(), cx)).await
}

#[inline(never)]
fn poll_profiled<F: Future>(future: Pin<&mut F>, cx: &mut Context<'_>) -> Poll<F::Output> {
    future.poll(cx)
}

/// A prefix for the keys of one `--profile` run on a store that outlives the process (Redis):
/// the process id and the time, so that an earlier run's records do not turn this run's
/// executions into replays. Empty for a store made for the run.
pub fn run_prefix(lasting_store: bool) -> String {
    if !lasting_store {
        return String::new();
    }
    let now = std::time::UNIX_EPOCH.elapsed().unwrap_or_default();
    format!("{}-{}-", std::process::id(), now.as_nanos())
}
