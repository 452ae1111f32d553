//! Stores a lock can live in. Each backend implements the same five operations with the same
//! semantics; everything above them (tokens, waiting, watchdog, loss signal) is shared.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::once::{Inspection, Parts, Purged, Record};
use crate::{LockError, LockName, MemoryLimits, OwnerId, Token};

pub(crate) mod memory;
#[cfg(test)]
mod model_tests;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod redis;
pub(crate) mod redlock;
pub(crate) mod waiters;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What kind of lock an operation is on.
#[derive(Clone, Debug)]
pub(crate) enum Mode {
    /// One holder at a time; the value is the holder's token.
    Exclusive,
    /// Exclusive, plus a completion record: once a record is stored, acquisitions return it.
    /// `tag` is stored while the lock is held and shown to contenders.
    Once { tag: Bytes, retention: Duration },
    /// Nested acquisitions by one owner; the token identifies one hold.
    Reentrant { owner: OwnerId },
}

/// One operation on one lock by one acquisition (identified by its token).
#[derive(Clone, Debug)]
pub(crate) struct Op {
    pub(crate) name: LockName,
    pub(crate) token: Token,
    pub(crate) lease: Duration,
    /// The clock drift allowance: a lease counts as held until `sent + lease - drift`.
    pub(crate) drift: Duration,
    /// Whether an exclusive acquisition draws a fencing token.
    pub(crate) fencing: bool,
    pub(crate) state_ttl: Option<Duration>,
    pub(crate) mode: Mode,
}

impl Op {
    /// Expiry of the state key in milliseconds, 0 for none. A `Once` keeps its state for the
    /// record retention.
    pub(crate) fn state_ttl_ms(&self) -> u64 {
        let ttl = match &self.mode {
            Mode::Once { retention, .. } => Some(*retention),
            _ => self.state_ttl,
        };
        ttl.map_or(0, millis)
    }
}

/// Where a new fencing counter starts (a run-once record's, a lock's with `fence_ttl`; on
/// Redis and Postgres): this machine's clock in microseconds, taken once per acquisition
/// attempt. The counter lives as long as the record (or `fence_ttl` after its last use); one
/// started again from 0 after it expired would repeat the fences given before. Started from
/// the clock, the fences of a name keep increasing as long as the clocks of the machines that
/// take it differ by less than the retention (or `fence_ttl`). The caller's clock, not the
/// server's: every Redlock master of one attempt gets the same start, so their counters agree
/// and the fence needs no second round.
pub(crate) fn counter_start() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        // Below 2^53: Lua counts in doubles, and a larger counter would lose its last digits.
        .min((1 << 53) - (1 << 32))
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Outcome of one acquisition attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Taken; the fencing token of this hold.
    Acquired { fence: u64 },
    /// Held by someone else; remaining lease if known, and (`Once`) the holder's tag, fence and
    /// the parts it appended so far (0 for the other kinds).
    Held {
        ttl: Option<Duration>,
        tag: Option<Bytes>,
        fence: u64,
        parts: u64,
    },
    /// (`Once` only) A completion record exists.
    Done { record: Record },
}

impl Attempt {
    /// Held, with no run-once details.
    pub(crate) fn held(ttl: Option<Duration>) -> Self {
        Attempt::Held {
            ttl,
            tag: None,
            fence: 0,
            parts: 0,
        }
    }
}

/// Outcome of one append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Appended {
    /// The part is stored at the index asked for (now, or by an earlier attempt of this same
    /// append whose reply was lost).
    Stored,
    /// The lock is not held by this token: nothing appended.
    NotOwner,
    /// The record holds `len` parts, and not this part at the index asked for.
    Mismatch { len: u64 },
}

/// `future` within `limit`. A store that answers at once (the in-memory store) is not given a
/// timer: the future is polled once first, and only one that is still pending is timed.
pub(crate) async fn timed<F: Future>(
    limit: Duration,
    future: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    use futures_util::FutureExt;
    let mut future = std::pin::pin!(future);
    match (&mut future).now_or_never() {
        Some(ready) => Ok(ready),
        None => tokio::time::timeout(limit, future).await,
    }
}

/// Releases (compare-and-delete) and wakes the next waiter in this client at once rather than
/// when the store's announcement comes back (the announcement carries the same token, so it
/// does not wake a second one).
///
/// A store across the network is not waited for: the waiter is woken as soon as the release is
/// on the connection, so its acquisition follows the release on that connection, the store runs
/// it right after the compare-and-delete, and the lock changes hands in one round trip instead
/// of two. Exclusion does not depend on it: the waiter only ever takes a free lock (`SET NX`).
/// Should the release find the lock no longer ours, that attempt finds the lock held and the
/// waiter waits on as before. Should the release reach the store after the waiter's attempt (a
/// reconnect between the two, a script reloaded after `NOSCRIPT`), its announcement wakes no
/// one (the waiter counts it as heard), so a waiter whose attempt after a wake failed looks
/// again after the shortest delay (see the acquire loop in `lock.rs`). A hand-over comes before
/// other clients' waiters can try, so not every release makes one
/// ([`waiters::Waiters::may_hand_over`]): one in nine wakes the local waiter once answered,
/// and they race as before.
///
/// A reentrant hold is one of several: whether its release freed the lock only the store
/// knows, and it announces (and the in-memory store wakes) only the last one, so no local
/// waiter is woken for nothing.
pub(crate) async fn release_and_wake(backend: &dyn Backend, op: &Op) -> Result<bool, LockError> {
    use futures_util::FutureExt;
    let wakes = !matches!(op.mode, Mode::Reentrant { .. });
    let mut release = backend.release(op);
    // One poll sends it (a store that answers at once, the in-memory one, answers it too).
    let answered = (&mut release).now_or_never();
    let early = answered.is_none() && wakes && backend.waiters().may_hand_over(op.name.channel());
    if early {
        wake_next(backend, op);
    }
    let released = match answered {
        Some(answered) => answered?,
        None => release.await?,
    };
    if released && !early {
        wake_next(backend, op);
    }
    Ok(released)
}

/// Wakes the next local waiter of `op`'s lock, which `op` released (not for a reentrant hold:
/// only the store knows whether its release freed the lock, and it announces the last one).
pub(crate) fn wake_next(backend: &dyn Backend, op: &Op) {
    if matches!(op.mode, Mode::Reentrant { .. }) {
        return;
    }
    backend
        .waiters()
        .wake(op.name.channel(), op.token.as_str().as_bytes());
}

/// The `appended` of [`Backend::complete`] for a one-part record that replaces the parts stored.
pub(crate) const REPLACE_PARTS: u64 = u64::MAX;

/// The operations a store must provide. All are atomic in the store.
pub(crate) trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Takes the lock if free (a reentrant lock also if held by the same owner), else reports
    /// the holder.
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>>;
    /// Sets the lease to `lease` if the lock is still held by `op.token`.
    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>>;
    /// Deletes the lock (one hold of a reentrant lock) if held by `op.token`, and announces it.
    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>>;
    /// (`Once`) Stores `record` and releases, if the lock is still held by `op.token`. With
    /// `appended` parts before it (streamed), `record` becomes part `appended` and the record is
    /// done with `appended + 1` parts; the store must hold exactly `appended` parts (else
    /// [`LockError::BrokenRecord`]). With `appended` = [`REPLACE_PARTS`], `record` is a
    /// one-part record that replaces whatever parts the store holds (they are deleted).
    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
        appended: u64,
    ) -> BoxFuture<'a, Result<bool, LockError>>;
    /// (`Once`) Appends `part` as part `index` of the record being written, if the lock is still
    /// held by `op.token`; recognises a retry of the same append.
    fn append<'a>(
        &'a self,
        op: &'a Op,
        index: u64,
        part: &'a [u8],
    ) -> BoxFuture<'a, Result<Appended, LockError>> {
        let _ = (index, part);
        Box::pin(std::future::ready(
            Err(self.unsupported(&op.name, "append")),
        ))
    }
    /// (`Once`) Up to `max` parts from `from` of the record being written or done, with its
    /// state, in one atomic read.
    fn parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Parts, LockError>> {
        let _ = (from, max);
        Box::pin(std::future::ready(Err(self.unsupported(name, "parts"))))
    }
    /// (`Once`) Up to `max` parts from `from` of a record already seen complete, without its
    /// state (see [`Once::stored_parts`](crate::Once::stored_parts)). By default, the parts
    /// of the atomic read.
    fn stored_parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<Bytes>, LockError>> {
        Box::pin(async move { Ok(self.parts(name, from, max).await?.into_parts()) })
    }
    /// What the store holds for `name`, in one atomic read.
    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Inspection, LockError>> {
        Box::pin(std::future::ready(Err(self.unsupported(name, "inspect"))))
    }
    /// Deletes `name`'s run-once state unless a lease holds it.
    fn purge<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Purged, LockError>> {
        Box::pin(std::future::ready(Err(self.unsupported(name, "purge"))))
    }
    /// The names under `prefix` whose state or lock key matches the glob `pattern` (applied to
    /// the name), every one once.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, LockError>> {
        let _ = prefix;
        Box::pin(std::future::ready(Err(LockError::Unsupported {
            name: pattern.to_owned(),
            operation: "scan",
            store: self.describe(),
        })))
    }
    /// (Postgres) Opens a transaction that holds `op`'s lock while `op` holds it: see
    /// [`OnceGuard::transaction`](crate::OnceGuard::transaction).
    #[cfg(feature = "postgres")]
    fn bind<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<postgres::Transaction, LockError>> {
        Box::pin(std::future::ready(Err(
            self.unsupported(&op.name, "transaction")
        )))
    }
    /// Whether [`bind`](Backend::bind) works on this store (Postgres).
    fn supports_transactions(&self) -> bool {
        false
    }
    /// Whether `append` and `parts` work on this store.
    fn supports_streaming(&self) -> bool {
        false
    }
    /// Whether an operation sent reaches the store ahead of every operation sent after it
    /// (one connection per server, commands in order); not on a pool of connections.
    fn sends_in_order(&self) -> bool {
        true
    }
    /// The bounds of an in-memory store (`None`: another store).
    fn memory_limits(&self) -> Option<MemoryLimits> {
        None
    }
    /// The largest record (a part, or a record written whole) locks with `config` store:
    /// [`MAX_PART_LEN`](crate::once::MAX_PART_LEN), or less where a record must travel within a
    /// timeout (Redlock).
    fn max_record_len(&self, config: &crate::LockConfig) -> usize {
        let _ = config;
        crate::once::MAX_PART_LEN
    }
    /// The error of a streaming operation this store does not offer.
    fn unsupported(&self, name: &LockName, operation: &'static str) -> LockError {
        LockError::Unsupported {
            name: name.as_str().to_owned(),
            operation,
            store: self.describe(),
        }
    }
    /// Connects and loads whatever the operations need, so the first real operation does not
    /// pay for it, and checks that the store lets the lock do its work on the keys of `probe`
    /// (a lock of the client's prefix): a refusal is a [`LockError::Config`] naming it. Returns
    /// what it found that weakens a promise (an evicting Redis).
    fn prepare<'a>(
        &'a self,
        probe: &'a LockName,
    ) -> BoxFuture<'a, Result<Vec<crate::StoreWarning>, LockError>>;
    /// Where waiters register for release notifications.
    fn waiters(&self) -> &Arc<waiters::Waiters>;
    /// Whether a failed attempt is rolled back on the nodes it won (Redlock), announcing a
    /// release that frees nothing the lock's holder had: a waiter woken by another client's
    /// rollback backs off before it tries again.
    fn rolls_back(&self) -> bool {
        false
    }
    /// A short description for logs ("redis", "memory", ...).
    fn describe(&self) -> String;
    /// Refuses a lock configuration this store cannot honour (a replica check or a node timeout
    /// that does not fit in its command timeout).
    fn check_config(&self, config: &crate::LockConfig) -> Result<(), crate::ConfigError> {
        let _ = config;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryBackend;
    use crate::{LockName, MemoryLimits, Token};

    #[tokio::test]
    async fn releasing_a_hold_that_is_not_the_last_wakes_no_waiter() {
        let backend = MemoryBackend::new(MemoryLimits::default());
        let hold = |owner: &OwnerId| Op {
            name: LockName::new("t", "r").unwrap(),
            token: Token::random(),
            lease: Duration::from_secs(10),
            drift: Duration::from_millis(2),
            fencing: true,
            state_ttl: None,
            mode: Mode::Reentrant {
                owner: owner.clone(),
            },
        };
        let me = OwnerId::random();
        let (outer, inner) = (hold(&me), hold(&me));
        for op in [&outer, &inner] {
            assert!(matches!(
                backend.acquire(op).await.unwrap(),
                Attempt::Acquired { .. }
            ));
        }
        let waiter = backend.waiters().register(outer.name.channel());
        async fn woken(w: &waiters::Waiter) -> bool {
            tokio::time::timeout(Duration::from_millis(50), w.notified())
                .await
                .is_ok()
        }
        assert!(release_and_wake(&backend, &inner).await.unwrap());
        assert!(
            !woken(&waiter).await,
            "the lock is still held: nobody to wake"
        );
        assert!(release_and_wake(&backend, &outer).await.unwrap());
        assert!(
            woken(&waiter).await,
            "the last release wakes the next waiter"
        );
    }
}
