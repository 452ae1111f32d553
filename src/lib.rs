//! tower-idempotency: a tower Layer that makes HTTP endpoints safe to call twice.

pub use distlock;
