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
