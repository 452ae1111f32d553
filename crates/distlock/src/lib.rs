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
//! | `SETNX` + `GETSET` lets a loser overwrite the holder's expiry (000) | acquisition is `SET key token NX PX lease`, one command, with the fencing `HINCRBY` behind it in the same pipeline (drawn while the lock is ours: the reply, which follows the draw, counts only if handled while the lease can still be proven; a `SET` whose draw failed is released), or, on a Cluster, a Sentinel-managed master and Redlock masters, one atomic script that draws the fence first and takes the lock last; nothing is ever written to a lock held by someone else, and an acquisition that cannot write all it must (a state key of another type, a command the ACL user may not run) leaves no lock behind |
//! | a constant value lets one caller release another's lock (002) | every acquisition has a fresh 128-bit [`Token`] from a CSPRNG seeded by the OS (no system call per acquisition); release is a Lua compare-and-delete, renewal a compare-and-pexpire |
//! | a crashed holder never unlocks (003, 004) | every lock has a lease; waiters wake when it ends |
//! | work outlives the lease (002: Redisson's watchdog) | a watchdog renews every `lease/3` while the guard lives |
//! | the holder does not know it lost the lock | [`LeaseWatch::lost`] fires at `sent + lease - drift` of the last confirmed acquire/renewal, measured with `Instant` from when it was *sent*, or at once when a renewal finds another owner |
//! | a paused holder writes after its lease ended (Kleppmann) | [`LockGuard::fence`]: a counter in the lock's hash slot, strictly increasing across holders; have the resource reject lower tokens |
//! | polling storms while waiting | waiters are woken by a release announcement over one shared pub/sub connection per client, one waiter per release, with jittered exponential backoff (capped by the holder's remaining lease) as the fallback |
//! | a timeout during acquire leaves a lock nobody knows about | the failed attempt's token is used to delete it in the background (retried until its lease would have ended), and the error says the outcome was ambiguous; the same when the caller drops the acquisition future while its command is in flight |
//! | release on unwind / cancellation (004 returns early without unlocking) | dropping the guard releases: a spawned compare-and-delete with a deadline (never `block_on` in `Drop`); the lease is the backstop |
//! | reentrancy (001, 002) | [`LockClient::reentrant`]: a hash lock with one field per hold, so a release removes exactly one hold |
//! | a duplicate request must not run twice, and should not wait for a long response to end | [`Once`]: the record is stored atomically with the release; it can be streamed part by part ([`OnceGuard::append`], idempotent by part index) and followed live by duplicates ([`Once::follow`]), every part guarded by the lease token and kept for the retention; a writer that died is reported, never replayed as a short record (see [`once`]) |
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
//!   the same way. Fencing tokens survive neither. Use [Redlock](#redlock) over independent
//!   masters, the [replica check](LockClientBuilder::replicas) on a Sentinel group, or make the
//!   protected resource check fencing tokens, when that matters.
//! * **A lease is time.** A holder paused longer than its lease (GC, SIGSTOP, a stalled
//!   runtime) can still be running when someone else holds the lock. The loss signal tells the
//!   holder as soon as its clock allows; the fencing token lets the resource reject its late
//!   writes. Nothing else can.
//! * **Clocks.** Validity assumes the Redis server and this process measure time at nearly the
//!   same rate; `drift` (default 1% of the lease + 2 ms) is the allowance.
//! * **Fencing tokens** are strictly increasing as long as the state key survives: forever by
//!   default, or for [`LockConfigBuilder::fence_ttl`] after the last use.
//! * **Eviction.** A Redis that reaches `maxmemory` under a `volatile-*` policy (the default
//!   of some managed services) may evict a held lock (a second client then takes it while the
//!   first works on) or a stored run-once record (the work runs again); under `allkeys-*` the
//!   fencing counters too, and fences start again. Run the lock's Redis with
//!   `maxmemory-policy noeviction`: a full Redis then refuses new locks and records instead.
//!   [`LockClient::prepare`] reads the policy where the user may run `CONFIG GET` and logs a
//!   warning otherwise ([`LockClient::prepare_with_warnings`] returns it): a warning rather
//!   than a refusal, since the lock works until the server fills up, the policy is often the
//!   operator's to set, and it can change after startup anyway. Where `CONFIG` is forbidden
//!   nothing is said.
//!
//! # Stores
//!
//! One API over every store: code written against [`LockClient`] runs unchanged on each.
//!
//! * **One Redis**: [`LockClientBuilder::connect`] or [`LockClientBuilder::redis`] with any
//!   `redis::aio::ConnectionLike + Clone` (multiplexed, `ConnectionManager`, cluster).
//! * **Redis Cluster**: [`LockClientBuilder::redis`] with a `redis::cluster_async::ClusterConnection`.
//!   Every script touches the keys of one lock only, and they share the hash tag `{name}`, so
//!   each script runs on the master owning that slot; MOVED and ASK are the cluster client's
//!   business. Release announcements are published from scripts and reach a subscriber on any
//!   node ([`notifications`](LockClientBuilder::notifications) with a client for one node).
//! * **Sentinel**: [`LockClientBuilder::sentinel`] follows the master across failovers; see
//!   [`sentinel`] for what a failover costs, and [`LockClientBuilder::replicas`] for the
//!   `WAIT` replica check.
//! * **Redlock** (N independent masters): see below.
//! * **Memory**: [`LockClient::memory`] runs the same operations in process memory, with the
//!   same semantics (lease expiry, fencing, notifications), bounded by [`MemoryLimits`]: for
//!   one process and tests.
//!
//! # Redlock
//!
//! [`LockClientBuilder::connect_redlock`] (or [`redlock`](LockClientBuilder::redlock) with your
//! own connections) holds one lock across N independent Redis masters, as the Redis
//! documentation describes it (article 001):
//!
//! * The same key and token go to all N masters **concurrently**, each with a timeout small
//!   against the lease ([`node_timeout`](LockClientBuilder::node_timeout)). The lock is held when
//!   a quorum (N/2 + 1) took it and validity remains: `lease - elapsed - drift`, drift = 1% of
//!   the lease + 2 ms, measured with `Instant`. Otherwise it is released on **all** masters,
//!   including those that seemed to fail (their command may run after its timeout), and waiting
//!   retries after a random (jittered) delay.
//! * Renewal and completion count only when a quorum confirms; the watchdog measures validity
//!   from when the renewal was sent, so the loss signal fires on time even if confirmations
//!   come late.
//! * **Fencing tokens**: each master's acquisition draws its counter + 1, atomically with taking
//!   the lock there; the fence F is the largest counter drawn. The next holder's fence is greater
//!   as long as F is *recorded* (a counter at F or above) on a quorum R of masters, each while
//!   the lock there is held: the next holder's quorum Q can only take a master after that lock is
//!   gone there, so after the record; R and Q intersect (two majorities do), counters never go
//!   down, and on a master in the intersection the next draw exceeds F.
//!   - The masters that drew F recorded it by their own acquisition. When they are a quorum (the
//!     normal case: every acquisition reaches every master and they draw the same counter), the
//!     fenced acquisition is **one round**, with no write-back.
//!   - When fewer than a quorum drew F (masters that missed acquisitions, restarted, or split
//!     between contenders), F is written back to the others that took the lock before the lock
//!     is used, raising their counters only while the lock there is ours; the acquisition fails
//!     unless the masters that drew F and those that confirm the write-back are a quorum.
//!   - When a quorum drew F, the masters that took the lock but drew less are raised to F in the
//!     background. Safety does not wait for it (R is a quorum already); it brings them level so
//!     the next acquisition is one round again. A raise that lands late (the lock released and
//!     taken by someone else, or again by the same reentrant owner) changes nothing harmful: it
//!     acts only while the lock there is the raise's own, and only ever raises; a higher counter
//!     only makes later fences larger.
//!
//!   This needs the masters in those intersections to keep their data: with `appendfsync always`
//!   on every master, tokens never repeat. A master that restarts empty keeps the lock safe under
//!   the restart rule below, but if it is the only master of R the next quorum includes, the next
//!   fence comes from the other masters' counters, which may lag: a token can repeat or go back.
//!   (No majority-quorum scheme can do better: tolerating the loss of a node's data needs
//!   quorums that overlap in two nodes.)
//! * **Restart rule**: a master that crashes and comes back without the keys it had can hand a
//!   second client a quorum while the first still holds the lock (the test suite shows it
//!   happening). Restart crashed masters only after the longest lease has passed, or run them
//!   with AOF and `appendfsync always` (the test suite shows both keeping the lock safe).
//! * A **quorum of masters unreachable** is [`LockError::NoQuorum`] (unavailable), distinct from
//!   [`LockError::Held`].
//! * **Run-once records are quorum decisions**: [`OnceGuard::complete`] counts only when a
//!   quorum stored the record, and [`Once::begin`] replays a record only when a quorum of masters
//!   hold that same record. A holder whose lease ran out on most masters may still store its
//!   record on a few (it is told [`LockError::LeaseLost`]); that minority record is never
//!   replayed, and those masters simply do not count for later acquisitions.
//! * **Records travel within timeouts.** A completion is given the node timeout plus the
//!   record's size at an assumed slowest link of 10 MiB/s on each master. `begin` answers with a
//!   record up to 64 KiB (less with a node timeout under 25 ms) and names a larger one by its
//!   size and SHA-1, stored with it; the quorum decides on those, then one master sends the
//!   record, given the same time for its size. A record larger than
//!   [`LockClient::max_record_len`] (what that link carries in the command timeout less two
//!   node timeouts: about 18 MiB with the defaults) is refused with [`LockError::TooLarge`]
//!   before anything is sent: it could not be stored and read back within the timeouts.
//! * **Start-up**: [`LockClient::prepare`] reaches every master at once and is ready when a
//!   quorum is; a frozen master joins when it answers (it connects lazily and loads the scripts
//!   on first use), so it never stalls a fresh client.
//! * Run-once and reentrant locks always fence, whatever [`LockConfigBuilder::fencing`] says.
//! * **Streamed run-once records are not offered** ([`LockError::Unsupported`],
//!   [`LockClient::supports_streaming`]): records are written whole, by quorum.
//!
//! # TLS
//!
//! `rediss://` URLs connect over TLS (rustls) for one Redis ([`LockClientBuilder::connect`]),
//! Redlock ([`LockClientBuilder::connect_redlock`]), Cluster ([`LockClientBuilder::connect_cluster`])
//! and Sentinel ([`LockClientBuilder::sentinel`]; the master too, or as
//! [`sentinel::SentinelConnectionBuilder::master_tls`] says). The system's roots are trusted
//! unless [`LockClientBuilder::tls`] gives a private CA; it also gives the client certificate for
//! mutual TLS. A server the client cannot trust (an untrusted CA, a name mismatch) is a
//! [`LockError::Config`] from [`LockClient::prepare`] naming the TLS failure (a
//! configuration to fix, apart from `Held` and `Unavailable`), and an `Unavailable`
//! error within the command timeout from any lock operation: never a hang. A server that
//! refuses the client's certificate (mutual TLS) says so with an alert, which TLS 1.3 delivers
//! after the client's side of the handshake: the client sees it, or only the closed
//! connection when its first command was already on the way.
//!
//! # ACL
//!
//! A least-privilege Redis user for locks under the prefix `myapp` (the `tower-idempotency`
//! layer's default prefix is `idem`) is created with exactly this line; [`acl_rules`] gives the
//! rules for any prefix:
//!
//! ```text
//! ACL SETUSER locks on >PASSWORD resetkeys ~myapp:* resetchannels &myapp:* -@all +fcall +evalsha +script|load +get +set +del +pexpire +pttl +type +hget +hmget +hset +hdel +hexists +hincrby +hsetnx +hlen +rpush +lindex +llen +lrange +publish +subscribe +unsubscribe +wait +role +cluster|slots
//! ```
//!
//! * **Commands**: `FCALL` for every operation where the server has the lock's function
//!   library, `EVALSHA` and `SCRIPT LOAD` where it does not (Redis 6, `FCALL` renamed away, a
//!   user without `+fcall`, or the library missing and not loadable), and what the scripts
//!   call, since Redis checks ACLs inside scripts too: `GET SET DEL PEXPIRE PTTL TYPE HGET
//!   HMGET HSET HDEL HEXISTS HINCRBY HSETNX HLEN RPUSH LINDEX LLEN LRANGE PUBLISH` (the list and hash
//!   commands for run-once records; `SET`, `HINCRBY`, `HSETNX`, `PEXPIRE`, `GET`, `PTTL` and `LRANGE`
//!   are also sent outside scripts). `SUBSCRIBE`/`UNSUBSCRIBE` carry the release
//!   notifications. Only some setups need the rest: `WAIT` the
//!   [replica check](LockClientBuilder::replicas), `ROLE` Sentinel (the client checks the
//!   master it is given), `CLUSTER SLOTS` Redis Cluster.
//! * **Not `FUNCTION LOAD`**: it would let the user replace any function library on the
//!   server, one a more privileged client calls included. A client whose user may loads the
//!   library itself; for this user, load [`function_library`] once as an administrator
//!   (`redis-cli -x FUNCTION LOAD < library.lua`; `cargo run -p distlock --example acl --
//!   --library` prints it), or its clients run the same scripts with `EVALSHA`, after one
//!   refused `FUNCTION LOAD` per connection in the ACL log. A version of this crate whose
//!   scripts changed brings a library of its own (about 16 KB, named `distlock_<hash>`); the
//!   earlier one stays on the server, as loaded functions do, until `FUNCTION DELETE`.
//! * **Keys**: `~myapp:*`: a lock's key `myapp:{name}` and its state `myapp:{name}:state`.
//! * **Channels**: `&myapp:*`: release announcements on `myapp:{name}:rel`. Without them (Redis
//!   7's default is `acl-pubsub-default resetchannels`) the lock warns once and waiters poll;
//!   releases and completions are unaffected (scripts publish with `redis.pcall`).
//! * **Not needed**: `EVAL`, `SCRIPT FLUSH`, `CONFIG`, `DEBUG`, `INFO`, `KEYS`, `SCAN`, `FLUSH*`,
//!   `CLIENT`. (Where the user may run `CONFIG GET`, [`LockClient::prepare`] reads the
//!   eviction policy: see [Limits](#limits). It checks first and does not send it otherwise;
//!   Redis 6 cannot check, and there a user without it has one refused `CONFIG GET` per
//!   `prepare` in the ACL log.) The connections this crate opens do not send redis-rs's `CLIENT SETINFO`
//!   (Valkey and Redis 7.2+ would log its refusal in the ACL log; Redis 7.0 does not know the
//!   command). Connections you build yourself, and those redis-rs opens through Sentinel, still
//!   send it and ignore the refusal: on Valkey or Redis 7.2+ add `+client|setinfo` to keep the
//!   ACL log quiet.
//!
//! Managed services often forbid `CONFIG`, `DEBUG` and `SCRIPT FLUSH` (the lock uses none of
//! them), and some refuse or rename `EVAL`/`EVALSHA`/`SCRIPT` or `FCALL`/`FUNCTION`. The lock
//! needs one of the two: functions when it may, else scripts (a refused or missing `FCALL` or
//! `FUNCTION LOAD` turns a client to scripts for good, at the cost of one refused command).
//! [`LockClient::prepare`] loads them and runs one on the client's keys, and a refusal of both
//! is a [`LockError::Config`] naming what was refused (`the Redis user may not run EVALSHA`,
//! `the server does not offer SCRIPT LOAD`, `may not access the lock's keys`), instead of an
//! error at the first acquisition. It also checks, without running any of them
//! (`redis.acl_check_cmd`, Redis 7 and Valkey), every command the lock sends on the client's
//! keys, and names the first one the user may not run (`the Redis user may not run HINCRBY on
//! the lock's keys`) or the server does not offer. On Redis 6, which cannot check, such a
//! command shows up at the first operation that sends it, as a [`LockError::Redis`] carrying
//! Redis's refusal; an acquisition refused a command takes no lock either way.
//! `cargo run -p distlock --example acl -- PREFIX` prints the rules.
//!
//! # Design decisions
//!
//! * **Reentrant holds share one key and never shorten it.** Every hold of a reentrant owner is
//!   promised its own lease, and a renewal (including one capped by
//!   [`max_hold`](LockConfigBuilder::max_hold)) only ever raises the key's expiry: the key lives
//!   at least as long as any live hold was promised, possibly until the latest promise made to
//!   a hold already released (never longer). The in-memory store does the same.
//! * **Validity is counted from when a command was sent**, never from its reply: a late reply
//!   shortens the lease the holder believes in, it never lengthens it past the key's expiry.
//! * **Cancellation is the normal case.** An acquisition attempt is guarded while its command is
//!   in flight: if the caller drops the future (a timeout around it, a client that went away, a
//!   `select!`), the same token-based cleanup runs as after an ambiguous error, and the lock the
//!   command may have taken is deleted at once rather than held for a lease. This covers
//!   [`Lock::acquire`], [`Once::begin`] and the Redlock fan-out. Such cleanups (and the releases
//!   of dropped guards) run in background tasks; [`LockClient::settle`] waits for them before a
//!   process exits.
//! * **Ambiguous means "may have run".** Only a command that may have reached the server is
//!   ambiguous (a timeout, a connection dropped after sending): a refused connection or an error
//!   reply is not, and spawns no cleanup.
//! * **The replica check waits for its own write.** With [`LockClientBuilder::replicas`], `WAIT`
//!   is sent in one pipeline right behind the script, so it runs on the connection that wrote:
//!   sent separately after a reconnect or a Sentinel switch it would count nothing and pass at
//!   once. A failed or short check after an acquisition releases the lock (or, if the release
//!   cannot be sent, reports an ambiguous error so the cleanup retries it).
//! * **Announcements never turn a write into an error.** Scripts publish release announcements
//!   with `redis.pcall`: an ACL user without channel rights (Redis 7's `resetchannels`) releases
//!   and completes normally. The notification task meets the same refusal on `SUBSCRIBE`: it
//!   warns once and stops trying, and waiters poll. Reconnections back off; nothing loops hot.
//!   [`LockConfigBuilder::polling`] turns the polling fallback off (tests use it to prove the
//!   announcements arrive).
//! * **In-memory fencing** uses one counter for the whole store ([`MemoryLimits`]): no counter per
//!   name, so ever-new names do not fill the store, and no eviction or expiry can make a name's
//!   fence go back.
//! * **Configurations that cannot work are refused when built**: a lease that is not a whole
//!   number of milliseconds (Redis would keep a shorter one), a drift below 1 ms (Redis counts
//!   expiries in whole milliseconds of its own clock), a command timeout that leaves no time to
//!   retry a renewal before the lease ends, a replica check or Redlock node timeout that does not
//!   fit in the command timeout of the client's or a lock's configuration (checked by every
//!   `with_config`, which returns a `Result`), values too large for Redis or `Instant`. Waits
//!   of `Duration::MAX` and an unbounded hold cap saturate; building a client outside a Tokio
//!   runtime is a [`ConfigError`] that says so, never a panic (a Redis client's connection
//!   manager is made with it; the memory client needs none).

mod acl;
mod backend;
mod backoff;
mod client;
mod clock;
mod config;
mod error;
mod guard;
mod lease;
mod lock;
mod name;
pub mod once;
#[cfg(feature = "postgres")]
pub mod postgres;
mod redact;
mod refusal;
pub mod sentinel;
mod tls;
mod token;
mod warning;
mod watchdog;

pub use acl::{acl_rules, function_library, operator_acl_rules};
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
pub use redact::redact_url;
pub use tls::Tls;
pub use token::{OwnerId, Token};
pub use warning::StoreWarning;
