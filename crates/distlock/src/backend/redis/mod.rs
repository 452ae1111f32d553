//! The lock on one Redis (standalone, a Sentinel-managed master, or a Redis Cluster): every
//! operation is one call of a script from `scripts/` (`FCALL` of its function, or `EVALSHA` where
//! the server has no functions for us: see `call.rs`), except an exclusive acquisition, plain
//! commands where they do (`RedisBackend::acquire_plain`); generic over any
//! `redis::aio::ConnectionLike` that can be cloned (multiplexed, managed or cluster connections).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::Value;
use redis::aio::ConnectionLike;

use super::waiters::Waiters;
use super::{Appended, Attempt, Backend, BoxFuture, Mode, Op, counter_start, millis};
use crate::once::{Holder, Inspection, Parts, Purged, Record, RecordState};
use crate::{LockError, LockName, StoreWarning};

mod call;
mod notify;
mod scripts;

use call::{Call, Calls, Recovery};
pub(crate) use notify::{Source, spawn_notifiers};
pub(crate) use scripts::LIBRARY;
use scripts::SCRIPTS;

/// A connection Redis lock operations can be sent on.
pub(crate) trait Conn: ConnectionLike + Clone + Send + Sync + 'static {}
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Conn for C {}

pub(crate) struct RedisBackend<C> {
    conn: C,
    waiters: Arc<Waiters>,
    describe: String,
    /// Replicas that must acknowledge an acquisition (`WAIT`), and how long to wait for them.
    replicas: Option<(usize, Duration)>,
    /// Whether this server is sent functions or scripts.
    calls: Arc<Calls>,
    /// Whether a fenced exclusive acquisition draws its fence in a pipeline behind its `SET`
    /// (one Redis, Cluster, Sentinel) or in the acquisition script (Redlock nodes, whose
    /// fences [`crate::backend::redlock`] combines).
    pipelined_fences: bool,
    /// (Redlock masters) The largest one-part record `begin` sends with its answer; a larger
    /// one is named by its size and digest, and read with [`RedisBackend::record`].
    inline_records: Option<usize>,
    /// (Redis Cluster) The connection as a cluster's, to reach every master for a `SCAN`.
    cluster: Option<redis::cluster_async::ClusterConnection>,
}

impl<C> std::fmt::Debug for RedisBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

impl<C: Conn> RedisBackend<C> {
    pub(crate) fn new(conn: C, waiters: Arc<Waiters>, describe: String) -> Self {
        RedisBackend {
            conn,
            waiters,
            describe,
            replicas: None,
            calls: Arc::default(),
            pipelined_fences: false,
            inline_records: None,
            cluster: None,
        }
    }

    /// (Redis Cluster) `SCAN`s go to every master of the cluster, through `cluster`.
    pub(crate) fn with_cluster(
        mut self,
        cluster: Option<redis::cluster_async::ClusterConnection>,
    ) -> Self {
        self.cluster = cluster;
        self
    }

    pub(crate) fn with_replicas(mut self, replicas: Option<(usize, Duration)>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Fenced exclusive acquisitions without a script (see [`RedisBackend::acquire_plain`]):
    /// for a connection to one server that is the whole store. Not for a Redlock master (its
    /// fence is combined with the others'), a Cluster (a slot moving between the `SET` and the
    /// `HINCRBY` makes the client send both again elsewhere: a `SET` there without its draw),
    /// nor a Sentinel-managed master (failovers are expected: the lock and its draw must
    /// replicate as one, which a script's effects do).
    pub(crate) fn with_pipelined_fences(mut self, on: bool) -> Self {
        self.pipelined_fences = on;
        self
    }

    /// (Redlock masters) `begin` answers with the size and digest of a one-part record longer
    /// than `bytes` ([`NodeAttempt::Large`]) instead of the record: a large record then costs
    /// one master's transfer, with a timeout of its own, not every master's within the node
    /// timeout.
    pub(crate) fn with_inline_records(mut self, bytes: usize) -> Self {
        self.inline_records = Some(bytes);
        self
    }
}

/// What one master answered to an acquisition attempt.
#[derive(Debug)]
pub(crate) enum NodeAttempt {
    /// The answer of [`Backend::acquire`].
    Attempt(Attempt),
    /// (Redlock masters) A one-part completion record too large to come with the answer: its
    /// size and SHA-1 (hex).
    Large { len: u64, digest: String },
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn bytes(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        Value::SimpleString(s) => Some(Bytes::from(s)),
        _ => None,
    }
}

/// Parses the reply of the acquire scripts: `{1, fence}`, `{0, pttl[, tag, fence, parts]}` or
/// `{2, record[, parts]}`.
pub(crate) fn parse_attempt(name: &str, reply: Value) -> Result<Attempt, LockError> {
    let bad = |detail: &str| LockError::protocol(name, format!("acquire: {detail}"));
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    let mut items = items.into_iter();
    let status = items
        .next()
        .as_ref()
        .and_then(int)
        .ok_or_else(|| bad("no status"))?;
    // An optional count after the required items: absent is `default`, present must be >= 0.
    let count = |item: Option<Value>, default: u64, what: &str| match item {
        None => Ok(default),
        Some(v) => int(&v)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(&format!("bad {what}"))),
    };
    match status {
        1 => {
            let fence = items.next().ok_or_else(|| bad("no fence"))?;
            let fence = count(Some(fence), 0, "fence")?;
            Ok(Attempt::Acquired { fence })
        }
        0 => {
            let pttl = items
                .next()
                .as_ref()
                .and_then(int)
                .ok_or_else(|| bad("no ttl"))?;
            let ttl = match pttl {
                // The key has no expiry: someone set it without a lease.
                -1 => None,
                // Gone since the check: free now.
                p if p < 0 => Some(Duration::ZERO),
                p => Some(Duration::from_millis(p as u64)),
            };
            let tag = items.next().and_then(bytes);
            let fence = count(items.next(), 0, "fence")?;
            let parts = count(items.next(), 0, "part count")?;
            Ok(Attempt::Held {
                ttl,
                tag,
                fence,
                parts,
            })
        }
        2 => {
            let first = items.next().ok_or_else(|| bad("no record"))?;
            let parts = count(items.next(), 1, "part count")?;
            let first = match (first, parts) {
                (Value::Nil, parts) if parts > 1 => {
                    return Err(LockError::broken(
                        name,
                        format!("part 0 of {parts} is missing"),
                    ));
                }
                (first, _) => bytes(first).ok_or_else(|| bad("no record"))?,
            };
            if parts == 0 {
                return Err(bad("a record of no parts"));
            }
            Ok(Attempt::Done {
                record: Record::new(first, parts),
            })
        }
        other => Err(bad(&format!("unknown status {other}"))),
    }
}

/// Parses the reply of `begin.lua`: the fence (an integer) when taken, the record (a string)
/// when completed in one part, else [`parse_attempt`]'s replies, or `{3, length, digest}` for a
/// record named instead of sent.
fn parse_begin(name: &str, reply: Value) -> Result<NodeAttempt, LockError> {
    match reply {
        Value::Int(fence) if fence >= 1 => {
            return Ok(NodeAttempt::Attempt(Attempt::Acquired {
                fence: fence as u64,
            }));
        }
        Value::Int(_) | Value::Nil => {
            return Err(LockError::protocol(
                name,
                format!("begin: unexpected reply {reply:?}"),
            ));
        }
        Value::BulkString(record) => {
            return Ok(NodeAttempt::Attempt(Attempt::Done {
                record: Record::new(Bytes::from(record), 1),
            }));
        }
        _ => {}
    }
    if let Value::Array(items) = &reply
        && items.first().and_then(int) == Some(3)
    {
        let bad = |detail: &str| LockError::protocol(name, format!("begin: {detail}"));
        let [_, len, digest] =
            <&[Value; 3]>::try_from(&items[..]).map_err(|_| bad("not three items"))?;
        let len = int(len)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad("bad record length"))?;
        let digest = bytes(digest.clone())
            .and_then(|d| String::from_utf8(d.to_vec()).ok())
            .ok_or_else(|| bad("bad record digest"))?;
        return Ok(NodeAttempt::Large { len, digest });
    }
    parse_attempt(name, reply).map(NodeAttempt::Attempt)
}

/// What `check.lua` found.
#[derive(Debug, PartialEq, Eq)]
struct Checked {
    /// The first command refused, and whether the server knows it (else it does not offer
    /// it); `None` when none is (or the server cannot tell).
    refused: Option<(String, bool)>,
    /// Whether the user may run `CONFIG GET`; `None` when the server cannot tell.
    config: Option<bool>,
}

/// Parses the reply of `check.lua`: `{command, why, config}`.
fn parse_check(name: &str, reply: Value) -> Result<Checked, LockError> {
    let bad = || LockError::protocol(name, format!("check: unexpected reply {reply:?}"));
    let Value::Array(items) = &reply else {
        return Err(bad());
    };
    let text = |v: &Value| bytes(v.clone()).and_then(|b| String::from_utf8(b.to_vec()).ok());
    let (Some(command), Some(why), Some(config)) = (
        items.first().and_then(text),
        items.get(1).and_then(text),
        items.get(2).and_then(int),
    ) else {
        return Err(bad());
    };
    Ok(Checked {
        refused: (!command.is_empty()).then(|| (command, why != "unknown")),
        config: match config {
            -1 => None,
            allowed => Some(allowed == 1),
        },
    })
}

/// The warning about a server's eviction policy, from what `CONFIG GET maxmemory*` answered:
/// none for `noeviction` (or no policy in the answer).
fn eviction_warning(store: &str, config: &HashMap<String, String>) -> Option<StoreWarning> {
    let policy = config.get("maxmemory-policy")?;
    if policy.eq_ignore_ascii_case("noeviction") {
        return None;
    }
    Some(StoreWarning::Eviction {
        store: store.to_owned(),
        policy: policy.clone(),
        maxmemory: config
            .get("maxmemory")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0),
    })
}

/// Parses the reply of `parts.lua`: `{state, fence, parts, stored, pttl, {part, ...}}`.
pub(crate) fn parse_parts(name: &str, from: u64, reply: Value) -> Result<Parts, LockError> {
    let bad = |detail: &str| LockError::protocol(name, format!("parts: {detail}"));
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    let [status, fence, count, stored, pttl, list] =
        <[Value; 6]>::try_from(items).map_err(|_| bad("not six items"))?;
    let number = |v: &Value, what: &str| {
        int(v)
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(&format!("bad {what}")))
    };
    let (fence, count, stored) = (
        number(&fence, "fence")?,
        number(&count, "part count")?,
        number(&stored, "stored count")?,
    );
    let parts = parse_list(name, "parts", list)?;
    let (state, lease_left) = match int(&status) {
        Some(2) if stored < count => {
            return Err(LockError::broken(
                name,
                format!("the record has {count} parts, the store holds {stored}"),
            ));
        }
        Some(2) if count == 0 => return Err(bad("a record of no parts")),
        Some(2) => (RecordState::Done { parts: count }, None),
        Some(1) => {
            let lease_left = int(&pttl)
                .and_then(|p| u64::try_from(p).ok())
                .map(Duration::from_millis);
            (RecordState::Writing { parts: count }, lease_left)
        }
        Some(0) => (RecordState::Abandoned, None),
        _ => return Err(bad(&format!("unknown state {status:?}"))),
    };
    Ok(Parts::new(from, parts, fence, state, lease_left))
}

/// The reply of `complete.lua` and `append.lua`: 1 done, 0 not ours, `-1 - n` when the list
/// holds `n` parts and not the ones expected. Returns `Ok(n)` for the last case.
fn parse_stored(name: &str, what: &str, reply: Value) -> Result<Result<bool, u64>, LockError> {
    match int(&reply) {
        Some(1) => Ok(Ok(true)),
        Some(0) => Ok(Ok(false)),
        Some(n) if n < 0 => Ok(Err((-1 - n) as u64)),
        _ => Err(LockError::protocol(
            name,
            format!("{what}: unexpected reply {reply:?}"),
        )),
    }
}

fn parse_flag(name: &str, what: &str, reply: Value) -> Result<bool, LockError> {
    match int(&reply) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(LockError::protocol(
            name,
            format!("{what}: unexpected reply {reply:?}"),
        )),
    }
}

/// The `LRANGE` indexes of up to `max` parts from `from` (Redis list indexes are signed 64-bit:
/// no list is that long).
fn list_range(from: u64, max: usize) -> (u64, u64) {
    let start = from.min(i64::MAX as u64);
    let last = start
        .saturating_add(max as u64)
        .saturating_sub(1)
        .min(i64::MAX as u64);
    (start, last)
}

/// A list of parts as Redis replies it.
fn parse_list(name: &str, what: &str, reply: Value) -> Result<Vec<Bytes>, LockError> {
    let bad = |detail: &str| LockError::protocol(name, format!("{what}: {detail}"));
    let Value::Array(list) = reply else {
        return Err(bad("no part list"));
    };
    list.into_iter()
        .map(|v| bytes(v).ok_or_else(|| bad("a part is not a string")))
        .collect()
}

/// The keys of a run-once record: lock, state, parts.
fn record_keys(name: &LockName) -> [&str; 3] {
    [name.lock_key(), name.state_key(), name.parts_key()]
}

/// The reply of the exclusive acquire script: the fence, or `-1 - pttl` when held.
pub(crate) fn parse_acquired(name: &str, reply: Value) -> Result<Attempt, LockError> {
    match int(&reply) {
        Some(fence) if fence >= 1 => Ok(Attempt::Acquired {
            fence: fence as u64,
        }),
        Some(0) => Ok(Attempt::held(None)),
        Some(held) => Ok(Attempt::held(Some(Duration::from_millis(
            (-1 - held) as u64,
        )))),
        None => Err(LockError::protocol(
            name,
            format!("acquire: unexpected reply {reply:?}"),
        )),
    }
}

/// Appends the draw of a fence to `pipe`: the counter's `HINCRBY`, then the state's expiry
/// when it has one. A counter that expires is made again from the caller's clock
/// ([`counter_start`], `HSETNX` before the `HINCRBY`): made again from 0, it would repeat the
/// fences of the holders before its expiry. Returns the index of the `HINCRBY`'s reply among
/// the draw's.
fn draw(pipe: &mut redis::Pipeline, op: &Op, start: u64) -> usize {
    let state = op.name.state_key();
    let ttl = op.state_ttl_ms();
    if ttl != 0 {
        pipe.cmd("HSETNX").arg(state).arg("n").arg(start);
    }
    pipe.cmd("HINCRBY").arg(state).arg("n").arg("1");
    if ttl != 0 {
        pipe.cmd("PEXPIRE").arg(state).arg(ttl);
        return 1;
    }
    0
}

/// The fence of the replies to [`draw`]'s commands (the `HINCRBY`'s at `at`); an error if any
/// of them failed.
fn drawn(
    name: &str,
    at: usize,
    replies: impl Iterator<Item = redis::RedisResult<Value>>,
) -> Result<u64, LockError> {
    let mut fence = None;
    for (i, reply) in replies.enumerate() {
        let reply = reply.map_err(|e| LockError::from_redis(name, false, e))?;
        if i == at {
            fence = int(&reply).filter(|f| *f >= 1);
        }
    }
    match fence {
        Some(fence) => Ok(fence as u64),
        None => Err(LockError::protocol(name, "acquire: HINCRBY drew no fence")),
    }
}

impl<C: Conn> RedisBackend<C> {
    /// A call of `script` on `keys`; the caller appends the arguments.
    fn call(&self, script: &'static scripts::LuaScript, keys: &[&str], args: usize) -> Call {
        self.calls.call(script, keys, args)
    }

    /// Sends `call` on this backend's connection (see [`call::send`]).
    async fn eval(&self, name: &LockName, ambiguous: bool, call: Call) -> Result<Value, LockError> {
        call::send(self.conn.clone(), &self.calls, call)
            .await
            .map_err(|e| LockError::from_redis(name.as_str(), ambiguous, e))
    }

    /// Sends `cmd` and, with the replica check on, `WAIT` right behind it in one pipeline: on
    /// the very connection that wrote. (`WAIT` counts acknowledgements of its own connection's
    /// writes; sent separately, after a reconnect or a Sentinel switch it would go out on a
    /// connection that wrote nothing and pass at once.) Returns the script's reply and, with the
    /// check on, the replicas that acknowledged it (or why `WAIT` failed).
    async fn eval_replicated(
        &self,
        op: &Op,
        ambiguous: bool,
        mut call: Call,
    ) -> Result<(Value, Option<Result<usize, LockError>>), LockError> {
        let Some((wanted, timeout)) = self.replicas else {
            return Ok((self.eval(&op.name, ambiguous, call).await?, None));
        };
        let name = op.name.as_str();
        let mut conn = self.conn.clone();
        let mut recovery = Recovery::default();
        loop {
            let mut pipe = redis::pipe();
            pipe.ignore_errors()
                .add_command(call.cmd.clone())
                .cmd("WAIT")
                .arg(wanted)
                .arg(millis(timeout));
            let replies: Vec<Value> = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| LockError::from_redis(name, ambiguous, e))?;
            let [reply, waited] = <[Value; 2]>::try_from(replies)
                .map_err(|r| LockError::protocol(name, format!("pipeline: {} replies", r.len())))?;
            let reply = match reply {
                Value::ServerError(error) => {
                    let error = redis::RedisError::from(error);
                    // Boxed, as in `call::send`: the rare path.
                    let again = Box::pin(recovery.retry(&mut conn, &self.calls, &mut call, &error))
                        .await
                        .map_err(|e| LockError::from_redis(name, false, e))?;
                    if again {
                        continue;
                    }
                    return Err(LockError::from_redis(name, false, error));
                }
                reply => reply,
            };
            let acknowledged = match waited {
                Value::Int(n) => Ok(usize::try_from(n).unwrap_or(0)),
                Value::ServerError(error) => Err(LockError::from_redis(
                    name,
                    false,
                    redis::RedisError::from(error),
                )),
                other => Err(LockError::protocol(name, format!("WAIT: {other:?}"))),
            };
            return Ok((reply, Some(acknowledged)));
        }
    }

    /// The outcome of a write's replica check: `Ok` when enough replicas acknowledged it.
    fn replicated(
        &self,
        op: &Op,
        acknowledged: Option<Result<usize, LockError>>,
    ) -> Result<(), LockError> {
        match (acknowledged, self.replicas) {
            (Some(Ok(acknowledged)), Some((wanted, _))) if acknowledged < wanted => {
                Err(LockError::NotReplicated {
                    name: op.name.as_str().to_owned(),
                    acknowledged,
                    wanted,
                })
            }
            (Some(Err(error)), _) => Err(error),
            _ => Ok(()),
        }
    }

    /// An exclusive acquisition without a script: `SET NX PX`, with (fenced) the `HINCRBY` of
    /// the fencing counter right behind it in one pipeline, and `GET` + `PTTL` for the case it
    /// is held. One round trip when the lock is free. Only on a connection to one server (see
    /// [`RedisBackend::with_pipelined_fences`]).
    ///
    /// The fence is not drawn atomically with the `SET`, and need not be: it is drawn after
    /// it, on the same connection, before the reply. A draw behind a `SET` that found the lock
    /// held burns a number (fences must increase, not be dense). A draw behind a `SET` that
    /// took the lock happens while the lock is this attempt's: the `SET` started the lease, and
    /// the draw came before the reply, which is used only if it is handled before the lease
    /// can no longer be proven (`sent + lease - drift`: [`crate::lock::attempt`] cleans up a
    /// later one as a timeout; the command timeout, under half of that, ends the wait for it
    /// sooner). So even a client stalled between writing the `SET` and the `HINCRBY` (a
    /// partial write on a busy connection) uses no fence drawn after its lease. The holders'
    /// leases do not overlap, so the fences drawn within them increase in the holders' order.
    /// (A draw before the `SET` could be overtaken: a holder whose `SET` came late would hold
    /// a smaller fence than the holder before it.)
    ///
    /// A `SET` that took the lock but whose draw failed (the state key of another type, a
    /// refused write) is released: a lock without its fence does not stay behind.
    async fn acquire_plain(&self, op: &Op, start: u64) -> Result<Attempt, LockError> {
        // One round trip when the lock is free (the common case); the holder's remaining
        // lease, which paces waiting, costs a second one only when it is not.
        let name = op.name.as_str();
        let key = op.name.lock_key();
        let mut conn = self.conn.clone();
        let mut set = redis::cmd("SET");
        set.arg(key)
            .arg(op.token.as_str())
            .arg("NX")
            .arg("PX")
            .arg(millis(op.lease));
        let ambiguous = |e| LockError::from_redis(name, true, e);
        if op.fencing {
            let mut pipe = redis::pipe();
            pipe.ignore_errors().add_command(set);
            let at = draw(&mut pipe, op, start);
            let replies: Vec<redis::RedisResult<Value>> =
                pipe.query_async(&mut conn).await.map_err(ambiguous)?;
            let mut replies = replies.into_iter();
            let taken = replies
                .next()
                .ok_or_else(|| LockError::protocol(name, "acquire: no reply to SET"))?
                .map_err(|e| LockError::from_redis(name, false, e))?;
            if taken != Value::Nil {
                return self.fenced(op, drawn(name, at, replies)).await;
            }
        } else {
            let taken: Value = set.query_async(&mut conn).await.map_err(ambiguous)?;
            if taken != Value::Nil {
                return Ok(Attempt::Acquired { fence: 0 });
            }
        }
        // Whose it is, too: the `SET` sent again (a cluster client resends a command whose
        // connection broke before its reply) finds this attempt's own token. (So a failure
        // here is ambiguous: that `SET` may have taken the lock.)
        let checked: Result<(Option<String>, i64), _> = redis::pipe()
            .get(key)
            .pttl(key)
            .query_async(&mut conn)
            .await;
        let pttl = match checked {
            Ok((holder, _)) if holder.as_deref() == Some(op.token.as_str()) => {
                if !op.fencing {
                    return Ok(Attempt::Acquired { fence: 0 });
                }
                // The fence drawn behind this copy may predate the copy that took the lock:
                // one is drawn now, while the lock is seen to be ours.
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                let at = draw(&mut pipe, op, start);
                let replies: Result<Vec<redis::RedisResult<Value>>, _> =
                    pipe.query_async(&mut conn).await;
                let fence = match replies {
                    Ok(replies) => drawn(name, at, replies.into_iter()),
                    Err(e) => Err(ambiguous(e)),
                };
                return self.fenced(op, fence).await;
            }
            Ok((_, pttl)) => pttl,
            // Not a string: a reentrant lock of the same name holds it (a hash).
            Err(e) if wrong_type(&e) => redis::cmd("PTTL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .map_err(|e| LockError::from_redis(name, false, e))?,
            Err(e) => return Err(ambiguous(e)),
        };
        Ok(Attempt::held(match pttl {
            // Expired between the two commands (-2), or no expiry at all (-1).
            -2 => Some(Duration::ZERO),
            -1 => None,
            p => Some(Duration::from_millis(p.max(0) as u64)),
        }))
    }

    /// An acquisition that took the lock, with the fence drawn for it: without one, it does not
    /// stand ([`undo`](Self::undo)).
    async fn fenced(&self, op: &Op, fence: Result<u64, LockError>) -> Result<Attempt, LockError> {
        match fence {
            Ok(fence) => Ok(Attempt::Acquired { fence }),
            Err(error) => Err(self.undo(op, error).await),
        }
    }

    /// An acquisition that took the lock and cannot stand (no fence drawn, too few replicas):
    /// the lock is released now, or, if that fails, by the caller's cleanup of an ambiguous
    /// attempt. Returns the error to report.
    async fn undo(&self, op: &Op, error: LockError) -> LockError {
        match self.release(op).await {
            Ok(_) => error,
            Err(release) => release.into_ambiguous_unavailable(),
        }
    }

    /// (Redlock) Raises this node's fencing counter to `fence` if the lock here is ours. The
    /// future owns what it needs (a clone of the connection), so it can run in the background.
    pub(crate) fn fence_sync(
        &self,
        op: &Op,
        fence: u64,
    ) -> impl Future<Output = Result<bool, LockError>> + Send + 'static {
        let mut call = self.call(
            &SCRIPTS.fence_sync,
            &[op.name.lock_key(), op.name.state_key()],
            3,
        );
        match &op.mode {
            Mode::Reentrant { owner } => call.cmd.arg(owner.as_str()).arg(fence).arg("r"),
            _ => call.cmd.arg(op.token.as_str()).arg(fence).arg("x"),
        };
        let (conn, calls, name) = (self.conn.clone(), self.calls.clone(), op.name.clone());
        async move {
            let reply = call::send(conn, &calls, call)
                .await
                .map_err(|e| LockError::from_redis(name.as_str(), false, e))?;
            parse_flag(name.as_str(), "fence_sync", reply)
        }
    }

    /// An acquisition attempt ([`Backend::acquire`]); a Redlock master
    /// ([`with_inline_records`](Self::with_inline_records)) may answer with a record's size
    /// and digest instead of a large record. A fencing counter made now starts from `start`
    /// ([`counter_start`], taken once per attempt: every Redlock master gets the same one).
    pub(crate) fn acquire_node<'a>(
        &'a self,
        op: &'a Op,
        start: u64,
    ) -> BoxFuture<'a, Result<NodeAttempt, LockError>> {
        if matches!(op.mode, Mode::Exclusive)
            && (!op.fencing || self.pipelined_fences)
            && self.replicas.is_none()
        {
            // A future of its own: its pipelines would otherwise grow a once-lock's `begin`,
            // past the size the allocator serves from its per-thread cache.
            return Box::pin(async move {
                Ok(NodeAttempt::Attempt(self.acquire_plain(op, start).await?))
            });
        }
        Box::pin(async move {
            let keys = [op.name.lock_key(), op.name.state_key()];
            let name = op.name.as_str();
            let (attempt, acknowledged) = match &op.mode {
                Mode::Exclusive => {
                    let mut call = self.call(&SCRIPTS.acquire, &keys, 4);
                    call.cmd
                        .arg(op.token.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms())
                        .arg(start);
                    let (reply, acknowledged) = self.eval_replicated(op, true, call).await?;
                    let attempt = match parse_acquired(name, reply)? {
                        // The unfenced kind hands out no fence, even through the script.
                        Attempt::Acquired { .. } if !op.fencing => Attempt::Acquired { fence: 0 },
                        attempt => attempt,
                    };
                    (NodeAttempt::Attempt(attempt), acknowledged)
                }
                Mode::Once { tag, .. } => {
                    let mut call = self.call(&SCRIPTS.begin, &record_keys(&op.name), 6);
                    call.cmd
                        .arg(op.token.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms())
                        .arg(tag.as_ref())
                        .arg(start);
                    if let Some(inline) = self.inline_records {
                        call.cmd.arg(inline);
                    }
                    let (reply, acknowledged) = self.eval_replicated(op, true, call).await?;
                    (parse_begin(name, reply)?, acknowledged)
                }
                Mode::Reentrant { owner } => {
                    let mut call = self.call(&SCRIPTS.reentrant_acquire, &keys, 5);
                    call.cmd
                        .arg(owner.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms())
                        .arg(op.token.as_str())
                        .arg(start);
                    let (reply, acknowledged) = self.eval_replicated(op, true, call).await?;
                    (
                        NodeAttempt::Attempt(parse_attempt(name, reply)?),
                        acknowledged,
                    )
                }
            };
            if let NodeAttempt::Attempt(Attempt::Acquired { .. }) = attempt
                && let Err(error) = self.replicated(op, acknowledged)
            {
                // Too few replicas have the lock, or the check itself failed: it does not count,
                // and it must not stay behind for a whole lease.
                return Err(Box::pin(self.undo(op, error)).await);
            }
            Ok(attempt)
        })
    }

    /// Reads the server's eviction policy (`CONFIG GET`): a warning unless it is `noeviction`.
    /// A refusal (`CONFIG` renamed away, a user without it on Redis 6, which cannot tell
    /// beforehand) is no error: the policy is then not checked.
    async fn eviction(&self) -> Option<StoreWarning> {
        let mut conn = self.conn.clone();
        let config: redis::RedisResult<HashMap<String, String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory*")
            .query_async(&mut conn)
            .await;
        match config {
            Ok(config) => eviction_warning(&self.describe, &config),
            Err(error) => {
                tracing::debug!(
                    store = %self.describe,
                    %error,
                    "the eviction policy could not be read: not checked"
                );
                None
            }
        }
    }

    /// (Redlock) The one-part record a master named by `digest` ([`NodeAttempt::Large`]), if it
    /// still holds that very record.
    pub(crate) fn record<'a>(
        &'a self,
        name: &'a LockName,
        digest: &'a str,
    ) -> BoxFuture<'a, Result<Option<Bytes>, LockError>> {
        Box::pin(async move {
            let mut call = self.call(&SCRIPTS.record, &[name.state_key()], 1);
            call.cmd.arg(digest);
            match self.eval(name, false, call).await? {
                Value::Nil => Ok(None),
                reply => bytes(reply)
                    .map(Some)
                    .ok_or_else(|| LockError::protocol(name.as_str(), "record: not a string")),
            }
        })
    }
}

impl<C: Conn> Backend for RedisBackend<C> {
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            match self.acquire_node(op, counter_start()).await? {
                NodeAttempt::Attempt(attempt) => Ok(attempt),
                // Only a Redlock master is asked to name large records instead of sending them.
                NodeAttempt::Large { .. } => Err(LockError::protocol(
                    op.name.as_str(),
                    "begin: a record named, not sent",
                )),
            }
        })
    }

    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let keys = [op.name.lock_key(), op.name.state_key()];
            let call = match &op.mode {
                Mode::Reentrant { owner } => {
                    let mut call = self.call(&SCRIPTS.reentrant_extend, &keys, 4);
                    call.cmd
                        .arg(owner.as_str())
                        .arg(millis(lease))
                        .arg(op.state_ttl_ms())
                        .arg(op.token.as_str());
                    call
                }
                mode => {
                    let once = record_keys(&op.name);
                    // A once-lock's parts live as long as its state.
                    let keys = if matches!(mode, Mode::Once { .. }) {
                        &once[..]
                    } else {
                        &keys[..]
                    };
                    let mut call = self.call(&SCRIPTS.extend, keys, 3);
                    call.cmd
                        .arg(op.token.as_str())
                        .arg(millis(lease))
                        .arg(op.state_ttl_ms());
                    call
                }
            };
            let (reply, acknowledged) = self.eval_replicated(op, false, call).await?;
            let renewed = parse_flag(op.name.as_str(), "extend", reply)?;
            if renewed {
                // A renewal only the master knows of is worth nothing after a failover.
                self.replicated(op, acknowledged)?;
            }
            Ok(renewed)
        })
    }

    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let call = match &op.mode {
                Mode::Reentrant { owner } => {
                    let mut call = self.call(&SCRIPTS.reentrant_release, &[op.name.lock_key()], 2);
                    call.cmd.arg(owner.as_str()).arg(op.token.as_str());
                    call
                }
                mode => {
                    // A once-lock released without a record takes its parts with it.
                    let keys = [op.name.lock_key(), op.name.parts_key()];
                    let keys = if matches!(mode, Mode::Once { .. }) {
                        &keys[..]
                    } else {
                        &keys[..1]
                    };
                    let mut call = self.call(&SCRIPTS.release, keys, 1);
                    call.cmd.arg(op.token.as_str());
                    call
                }
            };
            let reply = self.eval(&op.name, false, call).await?;
            parse_flag(op.name.as_str(), "release", reply)
        })
    }

    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
        appended: u64,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let mut call = self.call(&SCRIPTS.complete, &record_keys(&op.name), 5);
            call.cmd
                .arg(op.token.as_str())
                .arg(record)
                .arg(op.state_ttl_ms());
            if appended == super::REPLACE_PARTS {
                call.cmd.arg("-1");
            } else {
                call.cmd.arg(appended);
            }
            if let Some(inline) = self.inline_records {
                call.cmd.arg(inline);
            }
            let (reply, acknowledged) = self.eval_replicated(op, true, call).await?;
            match parse_stored(op.name.as_str(), "complete", reply)? {
                Ok(stored) => {
                    if stored {
                        self.replicated(op, acknowledged)?;
                    }
                    Ok(stored)
                }
                Err(held) => Err(LockError::broken(
                    op.name.as_str(),
                    format!("{appended} parts were appended, the store holds {held}"),
                )),
            }
        })
    }

    fn append<'a>(
        &'a self,
        op: &'a Op,
        index: u64,
        part: &'a [u8],
    ) -> BoxFuture<'a, Result<Appended, LockError>> {
        Box::pin(async move {
            let mut call = self.call(&SCRIPTS.append, &record_keys(&op.name), 4);
            call.cmd
                .arg(op.token.as_str())
                .arg(index)
                .arg(part)
                .arg(op.state_ttl_ms());
            let (reply, acknowledged) = self.eval_replicated(op, true, call).await?;
            match parse_stored(op.name.as_str(), "append", reply)? {
                Ok(true) => {
                    // A part only the master knows of is lost in a failover: retried.
                    self.replicated(op, acknowledged)?;
                    Ok(Appended::Stored)
                }
                Ok(false) => Ok(Appended::NotOwner),
                Err(len) => Ok(Appended::Mismatch { len }),
            }
        })
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Inspection, LockError>> {
        Box::pin(async move {
            let call = self.call(&SCRIPTS.inspect, &record_keys(name), 0);
            let reply = self.eval(name, false, call).await?;
            parse_inspection(name.as_str(), reply)
        })
    }

    fn purge<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Purged, LockError>> {
        Box::pin(async move {
            let mut call = self.call(&SCRIPTS.purge, &record_keys(name), 2);
            call.cmd.arg(name.purge_channel()).arg(name.as_str());
            let reply = self.eval(name, true, call).await?;
            let bad = || LockError::protocol(name.as_str(), "purge: unexpected reply");
            let Value::Array(reply) = reply else {
                return Err(bad());
            };
            match (reply.first().and_then(int), reply.get(1).and_then(int)) {
                (Some(0), Some(pttl)) => Ok(Purged::InFlight {
                    lease_left: ttl(pttl),
                }),
                (Some(1), Some(0)) => Ok(Purged::Absent),
                (Some(1), Some(_)) => {
                    if reply.get(2).and_then(int) == Some(0) {
                        tracing::warn!(
                            name = name.as_str(),
                            channel = name.purge_channel(),
                            "purged, but the announcement was refused (a user without channel \
                             rights): replay caches may replay the record until their max_age"
                        );
                    }
                    Ok(Purged::Deleted)
                }
                _ => Err(bad()),
            }
        })
    }

    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, LockError>> {
        Box::pin(async move {
            let separator = if prefix.is_empty() { "" } else { ":" };
            let matching = format!("{}{separator}{{{pattern}}}:state", escape_glob(prefix));
            let keys = match &self.cluster {
                None => scan_node(&mut self.conn.clone(), None, &matching).await,
                Some(cluster) => scan_cluster(cluster, &matching).await,
            }
            .map_err(|e| LockError::from_redis(pattern, false, e))?;
            let start = prefix.len() + separator.len() + 1;
            let mut names: Vec<String> = keys
                .into_iter()
                .filter_map(|key| {
                    let name = key.get(start..)?.strip_suffix("}:state")?;
                    Some(name.to_owned())
                })
                .collect();
            names.sort_unstable();
            names.dedup();
            Ok(names)
        })
    }

    fn parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Parts, LockError>> {
        Box::pin(async move {
            let (start, last) = list_range(from, max);
            let mut call = self.call(&SCRIPTS.parts, &record_keys(name), 3);
            call.cmd.arg(start).arg(last).arg(max);
            let reply = self.eval(name, false, call).await?;
            parse_parts(name.as_str(), from, reply)
        })
    }

    fn stored_parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<Bytes>, LockError>> {
        Box::pin(async move {
            if max == 0 {
                return Ok(Vec::new());
            }
            // A plain `LRANGE`: the parts script would copy every part into Lua and back, which
            // costs Redis about five times the read itself for 64 KiB parts.
            let (start, last) = list_range(from, max);
            let mut conn = self.conn.clone();
            let reply: Value = redis::cmd("LRANGE")
                .arg(name.parts_key())
                .arg(start)
                .arg(last)
                .query_async(&mut conn)
                .await
                .map_err(|e| LockError::from_redis(name.as_str(), false, e))?;
            let parts = parse_list(name.as_str(), "stored parts", reply)?;
            if parts.is_empty() {
                // Nothing there (a one-part record has no list; a part past the end; a record
                // gone): the atomic read says what there is, or what is wrong.
                return Ok(self.parts(name, from, max).await?.into_parts());
            }
            Ok(parts)
        })
    }

    fn supports_streaming(&self) -> bool {
        true
    }

    fn prepare<'a>(
        &'a self,
        probe: &'a LockName,
    ) -> BoxFuture<'a, Result<Vec<StoreWarning>, LockError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            self.calls
                .prepare(&mut conn, &SCRIPTS.all())
                .await
                .map_err(|e| LockError::from_redis("(scripts)", false, e))?;
            // Every command the lock sends on the client's keys, checked without running any.
            let call = self.call(&SCRIPTS.check, &record_keys(probe), 0);
            let reply = self.eval(probe, false, call).await?;
            let check = parse_check(probe.as_str(), reply)?;
            if let Some((command, known)) = check.refused {
                return Err(crate::refusal::refused_command(
                    &self.describe,
                    &command,
                    known,
                ));
            }
            if check.config == Some(false) {
                tracing::debug!(
                    store = %self.describe,
                    "the Redis user may not run CONFIG GET: the eviction policy is not checked"
                );
                return Ok(Vec::new());
            }
            Ok(self.eviction().await.into_iter().collect())
        })
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn check_config(&self, config: &crate::LockConfig) -> Result<(), crate::ConfigError> {
        match self.replicas {
            Some((_, timeout)) if timeout >= config.op_timeout() => {
                Err(crate::ConfigError::invalid(
                    "replicas",
                    format!(
                        "the WAIT timeout {timeout:?} must be below the command timeout {:?} (it is part of the same command)",
                        config.op_timeout()
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// Whether Redis refused a command (alone or in a pipeline) for the key's type.
fn wrong_type(error: &redis::RedisError) -> bool {
    error.code() == Some("WRONGTYPE")
        || error
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "WRONGTYPE"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(v: Vec<Value>) -> Value {
        Value::Array(v)
    }

    #[test]
    fn parses_the_exclusive_acquire_reply() {
        assert_eq!(
            parse_acquired("k", Value::Int(3)).unwrap(),
            Attempt::Acquired { fence: 3 }
        );
        assert_eq!(
            parse_acquired("k", Value::Int(-1 - 1500)).unwrap(),
            Attempt::held(Some(Duration::from_millis(1500)))
        );
        assert_eq!(
            parse_acquired("k", Value::Int(-1)).unwrap(),
            Attempt::held(Some(Duration::ZERO))
        );
        assert_eq!(
            parse_acquired("k", Value::Int(0)).unwrap(),
            Attempt::held(None)
        );
        assert!(parse_acquired("k", Value::Nil).is_err());
    }

    #[test]
    fn parses_every_acquire_reply() {
        assert_eq!(
            parse_attempt("k", arr(vec![Value::Int(1), Value::Int(7)])).unwrap(),
            Attempt::Acquired { fence: 7 }
        );
        assert_eq!(
            parse_attempt("k", arr(vec![Value::Int(0), Value::Int(1500)])).unwrap(),
            Attempt::held(Some(Duration::from_millis(1500)))
        );
        assert_eq!(
            parse_attempt(
                "k",
                arr(vec![
                    Value::Int(0),
                    Value::Int(-1),
                    Value::BulkString(b"fp".to_vec()),
                    Value::Int(4),
                    Value::Int(2),
                ])
            )
            .unwrap(),
            Attempt::Held {
                ttl: None,
                tag: Some(Bytes::from_static(b"fp")),
                fence: 4,
                parts: 2,
            }
        );
        assert_eq!(
            parse_attempt(
                "k",
                arr(vec![Value::Int(2), Value::BulkString(b"rec".to_vec())])
            )
            .unwrap(),
            Attempt::Done {
                record: Record::new(Bytes::from_static(b"rec"), 1)
            }
        );
        assert_eq!(
            parse_attempt(
                "k",
                arr(vec![
                    Value::Int(2),
                    Value::BulkString(b"head".to_vec()),
                    Value::Int(3)
                ])
            )
            .unwrap(),
            Attempt::Done {
                record: Record::new(Bytes::from_static(b"head"), 3)
            }
        );
    }

    /// A streamed record whose first part is gone is reported broken, never replayed short.
    #[test]
    fn a_streamed_record_missing_parts_is_broken() {
        let done = arr(vec![Value::Int(2), Value::Nil, Value::Int(3)]);
        assert!(matches!(
            parse_attempt("k", done),
            Err(LockError::BrokenRecord { .. })
        ));
        let parts = |state: i64, count: i64, stored: i64| {
            arr(vec![
                Value::Int(state),
                Value::Int(7),
                Value::Int(count),
                Value::Int(stored),
                Value::Int(-1),
                arr(vec![]),
            ])
        };
        assert!(matches!(
            parse_parts("k", 0, parts(2, 3, 2)),
            Err(LockError::BrokenRecord { .. })
        ));
        let read = parse_parts("k", 0, parts(2, 3, 3)).unwrap();
        assert_eq!(read.state(), RecordState::Done { parts: 3 });
        assert_eq!(read.fence(), 7);
        for bad in [parts(2, 0, 0), parts(9, 1, 1), Value::Nil, arr(vec![])] {
            assert!(
                matches!(
                    parse_parts("k", 0, bad.clone()),
                    Err(LockError::Protocol { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        for reply in [
            Value::Nil,
            arr(vec![]),
            arr(vec![Value::Int(1)]),
            arr(vec![Value::Int(1), Value::Int(-3)]),
            arr(vec![Value::Int(9), Value::Int(0)]),
            arr(vec![Value::Int(2)]),
        ] {
            assert!(
                matches!(
                    parse_attempt("k", reply.clone()),
                    Err(LockError::Protocol { .. })
                ),
                "{reply:?}"
            );
        }
        assert!(parse_flag("k", "release", Value::Nil).is_err());
    }
}

/// The pipelined acquisition against a real Redis, with interleavings placed by a connection
/// that runs other clients' commands between a reply and its handling.
#[cfg(test)]
mod pipelined_tests {
    use std::sync::{Arc, Mutex};

    use redis::AsyncCommands;

    use super::*;
    use crate::backend::waiters::Waiters;
    use crate::{LockName, Token};
    use testkit::HookedConnection;

    fn op(name: &LockName) -> Op {
        Op {
            name: name.clone(),
            token: Token::random(),
            lease: Duration::from_secs(10),
            drift: Duration::from_millis(2),
            fencing: true,
            state_ttl: None,
            mode: Mode::Exclusive,
        }
    }

    async fn backend(
        server: &testkit::RedisServer,
    ) -> (RedisBackend<HookedConnection>, HookedConnection) {
        let conn = HookedConnection::new(server.connection().await);
        let backend = RedisBackend::new(conn.clone(), Waiters::local(), "redis".into())
            .with_pipelined_fences(true);
        (backend, conn)
    }

    /// A cluster client resends an acquisition whose connection broke: the copy whose reply is
    /// handled found the lock held and drew a fence; then the holder released, another holder
    /// came and went, and the first copy's `SET` took the lock. The attempt sees its own token
    /// and holds the lock, after the other holder: its fence must be greater than that
    /// holder's, so it is drawn again (before: the copy's, drawn before the other holder's).
    #[tokio::test]
    async fn a_resent_acquisition_that_finds_its_own_token_draws_its_fence_then() {
        let server = testkit::RedisServer::start().await;
        let (backend, conn) = backend(&server).await;
        let name = LockName::new(&testkit::unique_prefix("resent"), "k").unwrap();
        let x = op(&name);
        let (key, state) = (name.lock_key().to_owned(), name.state_key().to_owned());
        let mut admin = server.connection().await;
        // W holds the lock.
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("w")
            .arg("PX")
            .arg(10_000)
            .query_async(&mut admin)
            .await
            .unwrap();
        let other_fence = Arc::new(Mutex::new(0u64));
        conn.after_next_reply({
            let (key, state, token) = (key.clone(), state.clone(), x.token.as_str().to_owned());
            let other_fence = other_fence.clone();
            let mut admin = admin.clone();
            move || {
                async move {
                    // W releases; Y takes the lock, draws, releases; X's first copy lands.
                    let _: () = admin.del(&key).await.unwrap();
                    let _: () = admin.set(&key, "y").await.unwrap();
                    let y: u64 = admin.hincr(&state, "n", 1).await.unwrap();
                    *other_fence.lock().unwrap() = y;
                    let _: () = admin.del(&key).await.unwrap();
                    let _: () = redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut admin)
                        .await
                        .unwrap();
                }
            }
        });
        let attempt = backend.acquire(&x).await.unwrap();
        let y = *other_fence.lock().unwrap();
        assert!(y > 0, "the interleaving ran");
        match attempt {
            Attempt::Acquired { fence } => {
                assert!(fence > y, "the holder after Y has fence {fence}, Y had {y}")
            }
            other => panic!("its own token holds the lock: {other:?}"),
        }
    }

    /// The `SET` takes the lock but the draw behind it fails (here the state key holds a
    /// string): the lock is released, not left held without a fence for its whole lease.
    #[tokio::test]
    async fn a_lock_whose_fence_could_not_be_drawn_is_released() {
        let server = testkit::RedisServer::start().await;
        let (backend, _) = backend(&server).await;
        let name = LockName::new(&testkit::unique_prefix("no-draw"), "k").unwrap();
        let mut admin = server.connection().await;
        let _: () = admin.set(name.state_key(), "not a hash").await.unwrap();
        let x = op(&name);
        assert!(backend.acquire(&x).await.is_err(), "no fence, no lock");
        let held: bool = admin.exists(name.lock_key()).await.unwrap();
        assert!(!held, "the lock taken without a fence is released");
    }
}

/// A remaining time in milliseconds (`PTTL`): `None` for no expiry (-1) or no key (-2).
fn ttl(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

/// The reply of `inspect.lua`.
fn parse_inspection(name: &str, reply: Value) -> Result<Inspection, LockError> {
    let bad = |what: &str| LockError::protocol(name, format!("inspect: {what}"));
    let Value::Array(mut fields) = reply else {
        return Err(bad("not an array"));
    };
    if fields.len() != 7 {
        return Err(bad("not 7 fields"));
    }
    let state_pttl = int(&fields[6]).ok_or_else(|| bad("state PTTL"))?;
    let parts = int(&fields[5]).ok_or_else(|| bad("parts"))?;
    let first = bytes(std::mem::replace(&mut fields[4], Value::Nil));
    let since = int(&fields[3]).and_then(|us| u64::try_from(us).ok());
    let tag = bytes(std::mem::replace(&mut fields[2], Value::Nil));
    let fence = int(&fields[1]).and_then(|n| u64::try_from(n).ok());
    let lock_pttl = int(&fields[0]).ok_or_else(|| bad("lock PTTL"))?;
    let holder = (lock_pttl != -2).then(|| Holder {
        lease_left: ttl(lock_pttl),
        fence: fence.unwrap_or(0),
        tag: tag.unwrap_or_default(),
        since: since.map(|us| std::time::UNIX_EPOCH + Duration::from_micros(us)),
    });
    let record = match u64::try_from(parts) {
        Ok(parts) if parts > 0 => Some(Record::new(first.unwrap_or_default(), parts)),
        _ => None,
    };
    Ok(Inspection {
        holder,
        record,
        fence,
        expires_in: ttl(state_pttl),
    })
}

/// `text` as a glob matching it literally.
fn escape_glob(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Every key matching `pattern` on one server (`SCAN`, a page at a time: never `KEYS`), sent on
/// `conn`, or through a cluster's connection to the master at `node`.
async fn scan_node<C: ConnectionLike>(
    conn: &mut C,
    node: Option<(&redis::cluster_async::ClusterConnection, &str, u16)>,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let reply = match node {
            None => scan.query_async::<Value>(conn).await?,
            Some((cluster, host, port)) => {
                use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.to_owned(),
                    port,
                });
                cluster.clone().route_command(scan, routing).await?
            }
        };
        let (next, page): (u64, Vec<String>) = redis::from_redis_value(reply)?;
        keys.extend(page);
        cursor = next;
        if cursor == 0 {
            return Ok(keys);
        }
    }
}

/// Every key matching `pattern` on every master of a cluster (`CLUSTER SLOTS` names them).
async fn scan_cluster(
    cluster: &redis::cluster_async::ClusterConnection,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let slots: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut cluster.clone())
        .await?;
    let mut masters: Vec<(String, u16)> = Vec::new();
    if let Value::Array(ranges) = slots {
        for range in ranges {
            let Value::Array(range) = range else { continue };
            let Some(Value::Array(master)) = range.get(2) else {
                continue;
            };
            let host = master
                .first()
                .and_then(|h| redis::from_redis_value::<String>(h.clone()).ok());
            let port = master
                .get(1)
                .and_then(int)
                .and_then(|p| u16::try_from(p).ok());
            if let (Some(host), Some(port)) = (host, port)
                && !masters.contains(&(host.clone(), port))
            {
                masters.push((host, port));
            }
        }
    }
    let mut keys = Vec::new();
    for (host, port) in &masters {
        let mut conn = cluster.clone();
        keys.extend(scan_node(&mut conn, Some((cluster, host, *port)), pattern).await?);
    }
    Ok(keys)
}
