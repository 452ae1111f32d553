//! Redlock: one lock across N independent Redis masters, the algorithm from the Redis
//! documentation (reference article 001).
//!
//! * **Acquire**: the same key and token are sent to all N nodes *concurrently*, each with a
//!   timeout small against the lease. The lock is ours if a quorum (N/2 + 1) took it and the
//!   validity left, `lease - elapsed - drift` (drift = 1% of the lease + 2 ms by default, all
//!   measured with `Instant`), is positive. Otherwise it is released on **all** nodes, including
//!   those that seemed to fail (their command may have run after the timeout), and the caller
//!   retries after a random delay (the waiting backoff has full jitter).
//! * **Fencing**: each node's acquisition draws that node's counter + 1, in the script that takes
//!   the lock there; the fence F is the largest counter drawn. What the next holder's larger
//!   fence needs is F *recorded* (the node's counter at F or above) on a quorum R_A of nodes,
//!   each at a time the lock there was A's. Argument: a later holder B takes a quorum Q_B only
//!   where the lock is free, hence after A's hold there ended, after the record, on each node of
//!   R_A ∩ Q_B, which is not empty (two majorities intersect); counters never go down, so on such
//!   a node B draws more than F, and B's fence, the largest of its draws, is greater than F.
//!   - A node that drew F recorded it by its own acquisition, atomically with taking the lock.
//!     When a quorum of nodes drew F, R_A is there when the replies are: no write-back, and the
//!     fenced acquisition is one round, like the unfenced one. This is the normal case: every
//!     acquisition reaches every node and they all draw the same counter.
//!   - Only when fewer than a quorum drew F (nodes lag: one missed acquisitions while it was
//!     down, frozen or slow, or restarted empty, or contenders split the nodes) is F written
//!     back (`fence_sync.lua`) to the other nodes that took the lock, before the lock is used: a
//!     second round, and the acquisition fails unless the nodes that drew F and those that
//!     confirm the write-back are a quorum. The script raises the counter only while the lock
//!     there is ours, so a confirmed write-back is a record in the sense above.
//!   - When a quorum drew F, the other nodes that took the lock but drew less are raised to F
//!     in the background (the same script), which the holder does not wait for. Safety does not
//!     need it (R_A is a quorum already); it brings the lagging nodes level so that the next
//!     acquisition finds the nodes agreeing (one round again), and so that more than a bare
//!     quorum records F (see restarts below). A raise that lands late, after A released and
//!     someone else, or A's own reentrant owner with a newer fence, took the lock there, does
//!     nothing harmful: the script acts only while the lock there is the raise's own (token, or
//!     owner id for reentrant locks), it only ever raises (the counter, and the fence a
//!     reentrant hold records), and a higher counter can only make later fences larger. The
//!     task is spawned as the acquisition returns (a dropped acquisition spawns none), holds no
//!     lock, is bounded by the node timeout, and counts for `LockClient::settle`.
//!
//!   This holds as long as the nodes in those intersections keep their data: run the nodes with
//!   `appendfsync always` for fencing tokens that never go back. A node that restarts empty
//!   keeps the *lock* safe under the delayed-restart rule, but its counter starts again; if it is
//!   the only node of R_A in the next quorum, the next fence is drawn from the other nodes'
//!   counters, which may lag: a token can repeat or go back. (Until a background raise lands,
//!   R_A is only the nodes that drew F; a write-back to every node before use would cover the
//!   lagging ones in that window too, at the price of a second round on every acquisition.)
//! * **Run-once records** are decided by quorum both ways: `complete` counts only when a quorum
//!   stored the record, and `begin` replays a record only when a quorum of nodes hold that same
//!   record. A holder whose lease ran out on most nodes may still store its record on a few (it
//!   is told `LeaseLost`); that minority record is never replayed, and the next holder's record,
//!   stored on a quorum, is the one every reader gets.
//! * **Records and timeouts.** A record is carried to (or from) a node within the node timeout
//!   plus its size at [`MIN_BANDWIDTH`] ([`RedlockBackend::carrying`]): a completion gets that
//!   time on every node. (With the node timeout alone, a record larger than the node timeout
//!   could carry was stored on every node and reported as no quorum, and every later `begin`
//!   timed out on every node for the whole retention.) A `begin` must not wait that long for
//!   every node (a frozen node would cost every acquisition as much), so a node sends a record
//!   with its answer only up to [`INLINE_RECORD`] (less with a short node timeout), and names a
//!   larger one by its size and SHA-1, which the completion stored with it: the quorum is
//!   decided on those, and the record is then read from one node that holds it, with the
//!   time to carry it, checked against its digest there (`record.lua`). A record is accepted
//!   only if both fit in the command timeout (`Backend::max_record_len`).
//! * **Streamed records are not supported**: `append` and `parts` answer
//!   `LockError::Unsupported` without sending anything (the trait's default), and
//!   `supports_streaming` is false. A reader would need a quorum read of every part, and a
//!   writer a quorum for every append; the layer writes records whole here instead.
//! * **Extend** and **complete** count only when a quorum confirms; the watchdog measures the
//!   new validity from when the renewal was sent, so a renewal confirmed too late counts for
//!   nothing (the loss signal has already fired).
//! * **Restart rule**: a node that crashes and restarts without the keys it had can give a second
//!   client a quorum while the first still holds the lock. Either restart crashed nodes only
//!   after the longest lease has passed (delayed restart), or persist every write (AOF with
//!   `appendfsync always`).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;

use super::redis::{Conn, NodeAttempt, RedisBackend};
use super::waiters::Waiters;
use super::{Attempt, Backend, BoxFuture, Mode, Op};
use crate::LockError;
use crate::once::{MAX_PART_LEN, Record};

/// The slowest link to a master Redlock plans for, in bytes per second (each master has its
/// own): an operation that carries `n` bytes (a record sent to be stored, or read back) is given
/// the node timeout plus `n` at this rate ([`RedlockBackend::carrying`]).
const MIN_BANDWIDTH: u64 = 10 << 20;

/// A one-part record up to this size comes back with `begin`'s answer (at most a quarter of the
/// node timeout at [`MIN_BANDWIDTH`]); a larger one is named by its size and digest and read from
/// one master with a timeout of its own.
const INLINE_RECORD: usize = 64 << 10;

pub(crate) struct RedlockBackend<C> {
    nodes: Vec<RedisBackend<C>>,
    quorum: usize,
    node_timeout: Duration,
    waiters: Arc<Waiters>,
    describe: String,
}

impl<C> std::fmt::Debug for RedlockBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("describe", &self.describe)
            .field("quorum", &self.quorum)
            .field("node_timeout", &self.node_timeout)
            .finish_non_exhaustive()
    }
}

/// The answers of all nodes to one operation, each within the node timeout.
struct Fanout<T> {
    results: Vec<Result<T, LockError>>,
}

impl<T> Fanout<T> {
    fn errors(&self) -> usize {
        self.results.iter().filter(|r| r.is_err()).count()
    }

    fn last_error(&mut self) -> Option<redis::RedisError> {
        self.results.iter_mut().rev().find_map(|r| match r {
            Err(LockError::Unavailable { source, .. } | LockError::Redis { source, .. }) => {
                Some(source.clone())
            }
            _ => None,
        })
    }
}

impl<C: Conn> RedlockBackend<C> {
    pub(crate) fn new(
        nodes: Vec<RedisBackend<C>>,
        node_timeout: Duration,
        waiters: Arc<Waiters>,
        describe: String,
    ) -> Self {
        let quorum = nodes.len() / 2 + 1;
        let inline = bytes_within(node_timeout / 4).min(INLINE_RECORD);
        let nodes = nodes
            .into_iter()
            .map(|node| node.with_inline_records(inline))
            .collect();
        RedlockBackend {
            nodes,
            quorum,
            node_timeout,
            waiters,
            describe,
        }
    }

    /// Runs `f` on every node at once, each bounded by the node timeout.
    async fn fanout<'a, T, F>(&'a self, op: &Op, f: F) -> Fanout<T>
    where
        F: Fn(&'a RedisBackend<C>) -> BoxFuture<'a, Result<T, LockError>>,
    {
        self.fanout_within(op, self.node_timeout, f).await
    }

    /// The time one master is given for an operation that carries `bytes` (a record sent or
    /// read): the node timeout, plus the bytes at [`MIN_BANDWIDTH`].
    fn carrying(&self, bytes: usize) -> Duration {
        self.node_timeout
            .saturating_add(Duration::from_secs_f64(bytes as f64 / MIN_BANDWIDTH as f64))
    }

    /// Runs `f` on every node at once, each bounded by `timeout`.
    async fn fanout_within<'a, T, F>(&'a self, op: &Op, timeout: Duration, f: F) -> Fanout<T>
    where
        F: Fn(&'a RedisBackend<C>) -> BoxFuture<'a, Result<T, LockError>>,
    {
        let name = op.name.as_str();
        let results = join_all(self.nodes.iter().map(|node| {
            let call = f(node);
            async move {
                match tokio::time::timeout(timeout, call).await {
                    Ok(result) => result,
                    Err(_) => Err(LockError::timeout(name, true, timeout)),
                }
            }
        }))
        .await;
        Fanout { results }
    }

    fn no_quorum(&self, op: &Op, confirmed: usize, source: Option<redis::RedisError>) -> LockError {
        LockError::NoQuorum {
            name: op.name.as_str().to_owned(),
            confirmed,
            nodes: self.nodes.len(),
            quorum: self.quorum,
            source,
        }
    }

    /// Rolls a failed attempt back on every node (the failed ones too), best effort. The
    /// rollback announces the attempt's token as released; this client's waiters, the attempt's
    /// own among them, are told it is no release of theirs to wake for (else a waiter whose
    /// attempts keep winning a minority would wake itself and try again at once, for as long
    /// as the lock is held).
    async fn release_all(&self, op: &Op) {
        self.waiters.heard(op.token.as_str().as_bytes());
        let _ = self.fanout(op, |node| node.release(op)).await;
    }

    /// Decides a yes/no operation: yes with a quorum of yes, no when a quorum of yes is no longer
    /// possible, and unavailable when errors leave it open.
    fn decide(&self, op: &Op, mut fanout: Fanout<bool>) -> Result<bool, LockError> {
        let yes = fanout
            .results
            .iter()
            .filter(|r| matches!(r, Ok(true)))
            .count();
        let no = fanout
            .results
            .iter()
            .filter(|r| matches!(r, Ok(false)))
            .count();
        if yes >= self.quorum {
            Ok(true)
        } else if no > self.nodes.len() - self.quorum {
            Ok(false)
        } else {
            let source = fanout.last_error();
            Err(self.no_quorum(op, yes, source))
        }
    }

    /// Raises the counters of `nodes` (which took the lock but drew less than `fence`) to the
    /// fence, in a background task, each only while the lock there is still ours. Not needed
    /// for this holder's fence (a quorum recorded it already): it keeps lagging nodes from
    /// staying behind, so that a later quorum does not depend on the few that are up to date.
    fn raise_in_background(&self, op: &Op, fence: u64, nodes: &[usize]) {
        if nodes.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let timeout = self.node_timeout;
        let calls: Vec<_> = nodes
            .iter()
            .map(|&node| tokio::time::timeout(timeout, self.nodes[node].fence_sync(op, fence)))
            .collect();
        let task = self.waiters.task();
        runtime.spawn(async move {
            let _task = task;
            let _ = join_all(calls).await;
        });
    }

    /// Reads the record of `len` bytes named by `digest` from the first of `holders` that still
    /// has it, each given the time to carry it ([`carrying`](Self::carrying)).
    async fn read_record(
        &self,
        op: &Op,
        len: u64,
        digest: &str,
        holders: &[usize],
    ) -> Result<Record, LockError> {
        let name = op.name.as_str();
        let timeout = self.carrying(usize::try_from(len).unwrap_or(usize::MAX));
        let mut source = None;
        for &node in holders {
            let read = tokio::time::timeout(timeout, self.nodes[node].record(&op.name, digest));
            let error = match read.await {
                Ok(Ok(Some(record))) if record.len() as u64 == len => {
                    return Ok(Record::new(record, 1));
                }
                // Gone since the first look (expired), or another record there now.
                Ok(Ok(_)) => continue,
                Ok(Err(error)) => error,
                Err(_) => LockError::timeout(name, false, timeout),
            };
            match error {
                LockError::Unavailable { source: s, .. } | LockError::Redis { source: s, .. } => {
                    source = Some(s);
                }
                other => return Err(other),
            }
        }
        Err(self.no_quorum(op, 0, source))
    }

    async fn acquire_quorum(&self, op: &Op) -> Result<Attempt, LockError> {
        let started = crate::clock::now();
        let start = super::counter_start();
        let mut fanout = self.fanout(op, |node| node.acquire_node(op, start)).await;
        // (node, the fence it drew) for every node that took the lock.
        let mut fences: Vec<(usize, u64)> = Vec::new();
        let mut held_ttl: Option<Duration> = None;
        let mut tag = None;
        let mut holder_fence = 0;
        let mut records: Vec<&Record> = Vec::new();
        // (node, size, digest) of every large record named instead of sent.
        let mut large: Vec<(usize, u64, &str)> = Vec::new();
        for (node, result) in fanout.results.iter().enumerate() {
            let attempt = match result {
                Ok(NodeAttempt::Attempt(attempt)) => attempt,
                Ok(NodeAttempt::Large { len, digest }) => {
                    large.push((node, *len, digest));
                    continue;
                }
                Err(_) => continue,
            };
            match attempt {
                Attempt::Held {
                    ttl, tag: t, fence, ..
                } => {
                    holder_fence = holder_fence.max(*fence);
                    if let Some(ttl) = ttl {
                        held_ttl = Some(held_ttl.map_or(*ttl, |h: Duration| h.min(*ttl)));
                    }
                    if tag.is_none() {
                        tag.clone_from(t);
                    }
                }
                Attempt::Acquired { fence } => fences.push((node, *fence)),
                Attempt::Done { record } => records.push(record),
            }
        }
        // "Done" is a quorum decision too: a record counts only when a quorum of nodes hold the
        // same one. A record on fewer nodes was stored by a holder that did not complete on a
        // quorum (it was told its lease was lost, and someone else may have done the work
        // since): it is never replayed, and those nodes simply do not count for this attempt.
        let decided = records
            .iter()
            .find(|r| records.iter().filter(|o| o == r).count() >= self.quorum)
            .map(|r| (*r).clone());
        if let Some(record) = decided {
            if !fences.is_empty() {
                self.release_all(op).await;
            }
            return Ok(Attempt::Done { record });
        }
        // The same for a large record, named by its size and digest: decided the same way, then
        // read from one of the masters that hold it, with a timeout for its size.
        let named = large
            .iter()
            .find(|&&(_, len, digest)| {
                large
                    .iter()
                    .filter(|&&(_, l, d)| l == len && d == digest)
                    .count()
                    >= self.quorum
            })
            .map(|&(_, len, digest)| (len, digest));
        if let Some((len, digest)) = named {
            let holders: Vec<usize> = large
                .iter()
                .filter(|&&(_, l, d)| l == len && d == digest)
                .map(|&(node, _, _)| node)
                .collect();
            let rollback = async {
                if !fences.is_empty() {
                    self.release_all(op).await;
                }
            };
            let (read, ()) = tokio::join!(self.read_record(op, len, digest, &holders), rollback);
            return read.map(|record| Attempt::Done { record });
        }
        // Run-once and reentrant locks always fence, whatever `fencing` says.
        let fenced = op.fencing || !matches!(op.mode, Mode::Exclusive);
        if fences.len() >= self.quorum && !fenced {
            if started.elapsed() + op.drift < op.lease {
                return Ok(Attempt::Acquired { fence: 0 });
            }
            self.release_all(op).await;
            return Err(self.no_quorum(op, fences.len(), None));
        }
        if fences.len() >= self.quorum {
            // The fence is the largest counter drawn. It must be recorded (a counter at the fence
            // or above) on a quorum of nodes while the lock is held there; the nodes that drew
            // it recorded it with their acquisition. Only if they are fewer than a quorum is it
            // written back to the others now, a second round; otherwise the lagging nodes are
            // raised in the background, which safety does not wait for (see the module docs).
            let fence = fences
                .iter()
                .map(|&(_, f)| f)
                .max()
                .expect("a quorum is not empty");
            let drew = fences.iter().filter(|&&(_, f)| f == fence).count();
            let lagging: Vec<usize> = fences
                .iter()
                .filter(|&&(_, f)| f < fence)
                .map(|&(node, _)| node)
                .collect();
            if drew >= self.quorum {
                if started.elapsed() + op.drift < op.lease {
                    self.raise_in_background(op, fence, &lagging);
                    return Ok(Attempt::Acquired { fence });
                }
                self.release_all(op).await;
                return Err(self.no_quorum(op, fences.len(), None));
            }
            let timeout = self.node_timeout;
            let name = op.name.as_str();
            let mut synced = Fanout {
                results: join_all(lagging.iter().map(|&node| {
                    let call = self.nodes[node].fence_sync(op, fence);
                    async move {
                        match tokio::time::timeout(timeout, call).await {
                            Ok(result) => result,
                            Err(_) => Err(LockError::timeout(name, true, timeout)),
                        }
                    }
                }))
                .await,
            };
            let confirmed = drew
                + synced
                    .results
                    .iter()
                    .filter(|r| matches!(r, Ok(true)))
                    .count();
            let validity_left = started.elapsed() + op.drift < op.lease;
            if confirmed >= self.quorum && validity_left {
                return Ok(Attempt::Acquired { fence });
            }
            self.release_all(op).await;
            let source = synced.last_error();
            return Err(self.no_quorum(op, confirmed.min(fences.len()), source));
        }
        let acquired = fences.len();
        if acquired > 0 || fanout.errors() > 0 {
            self.release_all(op).await;
        }
        if fanout.errors() > self.nodes.len() - self.quorum {
            let source = fanout.last_error();
            return Err(self.no_quorum(op, acquired, source));
        }
        // Held elsewhere (or split between contenders): not ours this time. (No parts: records
        // are written whole on Redlock.)
        Ok(Attempt::Held {
            ttl: held_ttl,
            tag,
            fence: holder_fence,
            parts: 0,
        })
    }
}

impl<C: Conn> Backend for RedlockBackend<C> {
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(self.acquire_quorum(op))
    }

    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let fanout = self.fanout(op, |node| node.extend(op, lease)).await;
            self.decide(op, fanout)
        })
    }

    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let fanout = self.fanout(op, |node| node.release(op)).await;
            self.decide(op, fanout)
        })
    }

    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
        appended: u64,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let timeout = self.carrying(record.len());
            let fanout = self
                .fanout_within(op, timeout, |node| node.complete(op, record, appended))
                .await;
            self.decide(op, fanout)
        })
    }

    fn prepare<'a>(
        &'a self,
        probe: &'a crate::LockName,
    ) -> BoxFuture<'a, Result<Vec<crate::StoreWarning>, LockError>> {
        Box::pin(async move {
            // All nodes at once, done as soon as a quorum is ready: a frozen or slow node must
            // not hold up a fresh client. The others join when they answer (they connect
            // lazily, and load the scripts on first use).
            let mut pending: FuturesUnordered<_> =
                self.nodes.iter().map(|node| node.prepare(probe)).collect();
            let (mut ok, mut source, mut refused) = (0, None, None);
            // What the masters ready so far found (those that answer later are not waited for).
            let mut warnings = Vec::new();
            while let Some(result) = pending.next().await {
                match result {
                    Ok(found) => {
                        ok += 1;
                        warnings.extend(found);
                    }
                    Err(
                        LockError::Unavailable { source: s, .. }
                        | LockError::Redis { source: s, .. },
                    ) => {
                        source = Some(s);
                    }
                    // A master refuses what the lock needs (the same ACL rules on every master,
                    // as a rule): said as such when it costs the quorum.
                    Err(error @ LockError::Config(_)) => refused = Some(error),
                    Err(_) => {}
                }
                if ok >= self.quorum {
                    return Ok(warnings);
                }
            }
            if let Some(refused) = refused {
                return Err(refused);
            }
            Err(LockError::NoQuorum {
                name: "(scripts)".into(),
                confirmed: ok,
                nodes: self.nodes.len(),
                quorum: self.quorum,
                source,
            })
        })
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    fn rolls_back(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn max_record_len(&self, config: &crate::LockConfig) -> usize {
        // A completion of n bytes is given `carrying(n)` per master, within one command
        // timeout; a `begin` that finds it spends a node timeout on the first look, then
        // `carrying(n)` reading it: both within the command timeout.
        let room = config
            .op_timeout()
            .saturating_sub(self.node_timeout.saturating_mul(2));
        bytes_within(room).min(MAX_PART_LEN)
    }

    fn check_config(&self, config: &crate::LockConfig) -> Result<(), crate::ConfigError> {
        let op_timeout = config.op_timeout();
        // (Divided, not multiplied: a timeout near `Duration::MAX` is refused, not an overflow.)
        if self.node_timeout.is_zero() || self.node_timeout > op_timeout / 3 {
            return Err(crate::ConfigError::invalid(
                "node_timeout",
                format!(
                    "{:?} must be above zero and at most a third of the command timeout {op_timeout:?} (an acquisition is up to three rounds)",
                    self.node_timeout
                ),
            ));
        }
        Ok(())
    }
}

/// The bytes a link at [`MIN_BANDWIDTH`] carries in `time`.
fn bytes_within(time: Duration) -> usize {
    let bytes = time.as_secs_f64() * MIN_BANDWIDTH as f64;
    // (`as` saturates.)
    bytes as usize
}
