//! Test support for the tower-idempotency workspace.
//!
//! * [`RedisServer`]: a real Redis for each test: `REDIS_URL`, else a local `redis-server` on a
//!   free loopback port (own temp dir, no persistence, killed on drop), else a container when a
//!   Docker engine answers, else a failure that says how to fix it. Owned servers can be stopped,
//!   paused (SIGSTOP/SIGCONT) and restarted on the same port.
//! * [`History`] and [`check`]: record critical sections (in memory or in a file shared by several
//!   processes) and prove there was never more than one holder and fencing tokens only grew.
//! * [`FaultProxy`]: a TCP proxy between a client and Redis that delays replies, holds them back
//!   from one that matches, limits the bandwidth (a slow link), drops a reply after its command
//!   ran, or black-holes connections.
//! * [`TestCa`] and [`ServerOptions::tls`]: a CA with server and client certificates, and a
//!   `redis-server` serving TLS with them (mutual TLS optional).
//! * [`RedisServer::acl_user`]: a least-privilege ACL user and the URL that logs in as it.
//! * [`HookedConnection`]: a connection that runs a hook between a reply and its handling (a
//!   stall, or other clients' commands placed there).

mod cluster;
mod fenced;
mod history;
mod hook;
mod postgres;
mod proxy;
mod sentinel;
mod server;
mod tls;

pub use cluster::RedisCluster;
pub use fenced::{FENCED_WRITE_LUA, FencedResource};
pub use history::{History, Open, Report, Section, check, instant_ns, now_ns};
pub use hook::HookedConnection;
pub use postgres::PostgresServer;
pub use proxy::FaultProxy;
pub use sentinel::{RedisSentinel, SERVICE as SENTINEL_SERVICE};
pub use server::{HarnessError, RedisServer, ServerOptions, free_port, free_port_pair};
pub use tls::TestCa;

/// A key prefix unique to one test run, so tests sharing a `REDIS_URL` server never collide.
/// Every such prefix is under [`TEST_PREFIX`]`:`, so that one ACL user
/// (`distlock::acl_rules(TEST_PREFIX)`, see `TESTKIT_ACL`) covers them all.
///
/// ```
/// assert!(testkit::unique_prefix("x").starts_with("t:x-"));
/// ```
pub fn unique_prefix(test: &str) -> String {
    format!("{TEST_PREFIX}:{test}-{}-{}", std::process::id(), now_ns())
}

/// A table name of its own for `test` (letters, digits and `_`, at most 48 characters).
///
/// ```
/// let a = testkit::unique_table("a test");
/// assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && a.len() <= 48);
/// assert_ne!(a, testkit::unique_table("a test"));
/// ```
pub fn unique_table(test: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let short: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(24)
        .collect();
    format!(
        "t_{short}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The prefix of every [`unique_prefix`].
pub const TEST_PREFIX: &str = "t";
