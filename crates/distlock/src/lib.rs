//! Distributed locks on Redis that get the details right.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use distlock::{LockClient, LockConfig};
//!
//! # let url = "redis://127.0.0.1:6379/";
//! # let client = LockClient::memory();
//! # let _ = url;
//! // let client = LockClient::builder().connect(url)?;       // Redis
//! // let client = LockClient::memory();                       // one process
//! let lock = client.lock("nightly-report")?;
//! let guard = lock.acquire(Duration::from_secs(30)).await?;   // wait up to 30 s
//! let fence = guard.fence();                                  // pass with every write
//! let lease = guard.lease();                                  // hand to the work
//! tokio::select! {
//!     reason = lease.lost() => eprintln!("lock lost ({reason}); stop writing"),
//!     _ = async { /* the protected work */ } => {}
//! }
//! guard.release().await?;
//! # let _ = fence;
//! # Ok(()) }
//! ```
//!
//! # What it guarantees, and how
//!
//! | problem (reference articles) | what this crate does |
//! |---|---|
//! | `SETNX` + `GETSET` lets a loser overwrite the holder's expiry (000) | acquisition is one atomic script: `SET key token NX PX lease` and the fencing `HINCRBY`; nothing is ever written to a lock held by someone else |
//! | a constant value lets one caller release another's lock (002) | every acquisition has a fresh 128-bit [`Token`] from the OS RNG; release is a Lua compare-and-delete, renewal a compare-and-pexpire |
//! | a crashed holder never unlocks (003, 004) | every lock has a lease; waiters wake when it ends |
//! | work outlives the lease (002: Redisson's watchdog) | a watchdog renews every `lease/3` while the guard lives |
//! | the holder does not know it lost the lock | [`LeaseWatch::lost`] fires at `sent + lease - drift` of the last confirmed acquire/renewal, measured with `Instant` from when it was *sent*, or at once when a renewal finds another owner |
//! | a paused holder writes after its lease ended (Kleppmann) | [`LockGuard::fence`]: a counter in the lock's hash slot, strictly increasing across holders; have the resource reject lower tokens |
//! | polling storms while waiting | waiters are woken by a release announcement over one shared pub/sub connection per client, one waiter per release, with jittered exponential backoff (capped by the holder's remaining lease) as the fallback |
//! | a timeout during acquire leaves a lock nobody knows about | the failed attempt's token is used to delete it in the background (retried until its lease would have ended), and the error says the outcome was ambiguous |
//! | release on unwind / cancellation (004 returns early without unlocking) | dropping the guard releases: a spawned compare-and-delete with a deadline (never `block_on` in `Drop`); the lease is the backstop |
//! | reentrancy (001, 002) | [`LockClient::reentrant`]: a hash lock with one field per hold, so a release removes exactly one hold |
//! | Redis Cluster | all keys of one lock share the hash tag `{name}`; every script touches one slot |
//!
//! Errors keep apart "held by someone else" ([`LockError::Held`]), "the wait deadline passed"
//! ([`LockError::WaitTimeout`]), "the store cannot be reached" ([`LockError::Unavailable`]) and
//! "the lease was lost" ([`LockError::LeaseLost`]). Configurations that cannot work are refused
//! when they are built ([`LockConfig::builder`]), with the reason.
//!
//! # Limits
//!
//! * **One Redis is one point of failure.** If the master fails over before the lock key reached
//!   the replica (replication is asynchronous), the new master does not have the lock and a second
//!   client can take it (article 001). A Redis restarted without persistence forgets every lock
//!   the same way. Fencing tokens survive neither. Use Redlock over independent masters, or make
//!   the protected resource check fencing tokens, when that matters.
//! * **A lease is time.** A holder paused longer than its lease (GC, SIGSTOP, a stalled
//!   runtime) can still be running when someone else holds the lock. The loss signal tells the
//!   holder as soon as its clock allows; the fencing token lets the resource reject its late
//!   writes. Nothing else can.
//! * **Clocks.** Validity assumes the Redis server and this process measure time at nearly the
//!   same rate; `drift` (default 1% of the lease + 2 ms) is the allowance.
//! * **Fencing tokens** are strictly increasing as long as the state key survives: forever by
//!   default, or for [`LockConfigBuilder::fence_ttl`] after the last use.
//!
//! # Stores
//!
//! [`LockClient::memory`] runs the same operations in process memory, with the same semantics
//! (lease expiry, fencing, notifications), bounded by [`MemoryLimits`]: for one process and tests.

mod backend;
mod backoff;
mod client;
mod config;
mod error;
mod guard;
mod lease;
mod lock;
mod name;
pub mod once;
pub mod sentinel;
mod token;
mod watchdog;

pub use backend::memory::MemoryLimits;
pub use backoff::Backoff;
pub use client::{DEFAULT_PREFIX, LockClient, LockClientBuilder};
pub use config::{ConfigError, LockConfig, LockConfigBuilder};
pub use error::{LockError, LossReason};
pub use guard::LockGuard;
pub use lease::LeaseWatch;
pub use lock::Lock;
pub use name::{LockName, MAX_NAME_LEN};
pub use once::{Begin, Once, OnceGuard};
pub use token::{OwnerId, Token};
