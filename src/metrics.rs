//! Outcome counters and store latency, through the `metrics` facade when the `metrics` feature
//! is on (no-ops otherwise). The names and labels are documented for users in the crate docs
//! ("Traces and metrics"); `tests/metrics.rs` checks them.

use std::time::Duration;

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// The handler ran and its response was stored.
    Executed,
    /// A stored response was replayed.
    Replayed,
    /// Another request with the key was in flight (409).
    Conflict,
    /// The key was reused with another fingerprint (422).
    Mismatch,
    /// The request was refused before the handler (400, 408, 413, 415, 500 unreadable record).
    Rejected,
    /// The handler ran but its lease was lost: nothing was stored.
    LeaseLost,
    /// The store failed (503 in fail-closed mode, or a failed completion).
    StoreError,
    /// The store failed and the handler ran unprotected (fail-open mode).
    FailOpen,
    /// The handler ran; its response was retryable: the key was released, nothing stored.
    NotStored,
    /// The handler started and its outcome is unknown (panic, error, failed body).
    Unknown,
    /// Not covered (method) or no key while keys are optional.
    Passthrough,
}

impl Event {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Event::Executed => "executed",
            Event::Replayed => "replayed",
            Event::Conflict => "conflict",
            Event::Mismatch => "mismatch",
            Event::Rejected => "rejected",
            Event::LeaseLost => "lease_lost",
            Event::StoreError => "store_error",
            Event::FailOpen => "fail_open",
            Event::NotStored => "not_stored",
            Event::Unknown => "outcome_unknown",
            Event::Passthrough => "passthrough",
        }
    }
}

pub(crate) fn count(outcome: Event) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_outcomes_total", "outcome" => outcome.as_str()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

pub(crate) fn store_latency(op: &'static str, took: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_store_seconds", "op" => op).record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (op, took);
}
