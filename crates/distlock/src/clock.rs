//! The one clock of the crate: `tokio::time::Instant`, so that leases, the watchdog and the
//! in-memory store all follow a paused Tokio clock in tests (`tokio::time::pause`), and plain
//! `std::time::Instant` in production.

use std::time::{Duration, Instant};

/// Now, on Tokio's clock (the real monotonic clock unless a test paused it).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Whether this runs on a Tokio runtime (its timers and tasks can be used). A task's poll knows
/// without touching the runtime's shared handle (whose count every worker would bounce between
/// cores, once per request); outside a task, the handle is asked.
pub(crate) fn on_tokio() -> bool {
    tokio::task::try_id().is_some() || tokio::runtime::Handle::try_current().is_ok()
}

/// About 30 years: "forever" for a deadline, and still far from `Instant`'s limits.
const FAR: Duration = Duration::from_secs(30 * 365 * 86_400);

/// `at + after`, saturating at a far future instead of overflowing (a `Duration::MAX` wait
/// means "as long as it takes").
pub(crate) fn after(at: Instant, after: Duration) -> Instant {
    at.checked_add(after.min(FAR))
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_saturate() {
        let now = now();
        assert!(after(now, Duration::MAX) > now + Duration::from_secs(86_400 * 365));
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }
}
