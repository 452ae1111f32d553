//! Run-once: a lock whose holder can store a completion record atomically with its release, so
//! that later callers get the record instead of the lock.
//!
//! This is what an idempotent endpoint needs, in two round trips: `begin` either takes the lock,
//! returns the stored record, or reports who is in flight (with their tag, for example a request
//! fingerprint); `complete` stores the record only if the lease is still ours.
//!
//! # Streamed records
//!
//! A record is a sequence of **parts** (opaque byte strings, each at most [`MAX_PART_LEN`]).
//! The holder may append parts while it works ([`OnceGuard::append`]) and ends with
//! [`OnceGuard::complete`], whose argument becomes the last part. Readers follow the record
//! while it is written ([`Once::follow`], [`Once::wait_parts`]) or read it later
//! ([`Once::parts`]); a duplicate waiting in [`Once::begin_wait`] is told as soon as the first
//! part exists, so that it can join the live stream. A record completed without appends is the
//! one-part case and costs what it always did: one round trip for `begin`, one for `complete`,
//! no extra key.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::{Duration, Instant};
//! use distlock::{Begin, once::RecordState};
//! let once = distlock::LockClient::memory().once("chat-completion-42")?;
//! let Begin::Acquired(writer) = once.begin("fp").await? else { unreachable!() };
//! writer.append(b"Hello").await?;
//!
//! // A duplicate arrives: the record is being streamed, it joins from part 0.
//! let Begin::InFlight { fence, parts, .. } = once.begin_wait("fp", Duration::from_secs(5)).await? else {
//!     unreachable!()
//! };
//! assert_eq!(parts, 1);
//! let mut joiner = once.follow(0).expect_writer(fence);
//! let read = joiner.next(16, Instant::now() + Duration::from_secs(5)).await?;
//! assert_eq!(read.parts(), [&b"Hello"[..]]);
//!
//! writer.complete(b", world").await?;
//! let read = joiner.next(16, Instant::now() + Duration::from_secs(5)).await?;
//! assert_eq!(read.parts(), [&b", world"[..]]);
//! assert!(read.is_complete());
//! # Ok(()) }
//! ```
//!
//! ## Data layout on Redis
//!
//! Every key of a record shares the hash tag `{name}` (one Cluster slot), and every operation is
//! one script (`begin`, `append`, `complete`, `parts`, `extend`, `release`, each in its own
//! `.lua` file, loaded once):
//!
//! | key | type | holds | expiry |
//! |---|---|---|---|
//! | `prefix:{name}` | string | the holder's token | the lease |
//! | `prefix:{name}:state` | hash | `n` the fencing counter (the current or last holder's fence; a new one starts from the writer's clock in microseconds, so a record begun again after it expired never repeats a fence), `m` the holder's tag while it holds, then the token that completed the record, `d` a one-part record, `p` the part count of a complete streamed record, and on Redlock masters, for a record over 64 KiB, `l` its length and `h` its SHA-1 (which `begin` answers with instead of the record) | the retention |
//! | `prefix:{name}:parts` | list | part *i* at index *i*: the parts of the holder writing, or of the complete streamed record; absent for one-part records | the retention |
//! | `prefix:{name}:rel` | channel | a release or completion announces the token; an append announces `+` and the part's index | — |
//!
//! The retention of the state and parts keys is set again by `begin`, every renewal of the
//! lease, every append and the completion: no part expires before the record would.
//!
//! ## Idempotent appends
//!
//! The guard counts the parts stored, and every append names the index of its part. The script
//! appends only while the lock holds the guard's token and the list holds exactly `index`
//! parts. If the list holds `index + 1` parts and the last one is this very part, the call is a
//! retry of an append whose reply was lost (a dropped connection, a timeout): it is
//! acknowledged, not stored twice. Anything else is refused ([`LockError::BrokenRecord`]), so a
//! stored part is never silently different from what the writer sent. Appends of one guard run
//! one at a time, and transient failures are retried while the lease can be proven held, as
//! completions are. Completion after appends checks that the list holds exactly the parts
//! appended, pushes the last one and marks the record done with its count (`p`), atomically
//! with the release; a retried completion is recognised by its token (`m`), as before.
//!
//! ## Writers and readers
//!
//! * **A new writer starts clean.** A holder's lease can run out mid-stream (it died, paused, or
//!   lost Redis for too long): its parts stay until the next `begin` takes the lock, which
//!   deletes them in the same script and draws a greater fence. A holder that lost its lease
//!   appends and completes nothing ([`LockError::LeaseLost`]). Aborting or dropping a guard
//!   deletes its parts with the lock.
//! * **Reads are atomic and name their writer.** [`Once::parts`] returns the parts together
//!   with the record's state and the writer's fence, from one script. A reader that sees the
//!   fence change knows another writer started over and must not append what it reads to what
//!   it read before; [`Follower`] does that check and reports [`RecordState::Abandoned`] for the
//!   writer it followed. Parts of two writers are never mixed.
//! * **Abandoned is not a record.** No holder and no record ([`RecordState::Abandoned`]) means
//!   the writer died, aborted or lost its lease: a reader reports an error, never presents what
//!   it read as complete. A part of a completed record that is missing from the store (evicted,
//!   deleted) is [`LockError::BrokenRecord`], never a short record.
//! * **Waiting.** An append announces its progress on the lock's channel, which every client
//!   hears over its one shared pub/sub connection: every waiting reader wakes (a release still
//!   wakes one waiting acquirer, and the announcement of an append frees no one). Readers
//!   subscribe before they look, so nothing announced in between is missed; they poll with
//!   backoff when notifications are off or refused, and look again when the writer's lease
//!   ends (a dead writer announces nothing).
//!
//! ## In memory
//!
//! [`LockClient::memory`](crate::LockClient::memory) keeps the parts with the run-once state,
//! with the same semantics and in-process wake-ups. Parts count against
//! [`MemoryLimits`](crate::MemoryLimits) bytes: an append that does not fit is refused
//! ([`LockError::Capacity`]) and appends nothing. The parts of a held lock are never evicted; a
//! completed streamed record can be, like any idle record (a reader then sees `Abandoned`).
//!
//! ## On Postgres
//!
//! The Postgres store (feature `postgres`) keeps the parts in a table of their own, with the
//! same semantics: appends and completions are functions that lock the name's row and check
//! the lease and the part count, reads are one statement. Readers in the writer's process are
//! woken by its appends and completion; readers elsewhere poll with backoff (nothing is
//! announced across processes: [`LockConfigBuilder::polling`](crate::LockConfigBuilder::polling)
//! must stay on for them). In a transaction bound to the lease
//! ([`OnceGuard::transaction`]) the parts are appended in it and commit with the record.
//!
//! ## Redlock
//!
//! Streaming is not offered on Redlock: a reader would need a quorum read of every part, and
//! an append a quorum decision of its own. [`OnceGuard::append`], [`Once::parts`] and the
//! waits return [`LockError::Unsupported`] without sending anything, and
//! [`LockClient::supports_streaming`] is false, so a caller can fall back to whole records,
//! which keep their quorum semantics (a record is replayed only when a quorum holds it). A
//! record must reach every master within the timeouts: one larger than
//! [`LockClient::max_record_len`] is refused ([`LockError::TooLarge`]) before it is sent (see
//! [the crate docs](crate#redlock)).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::backend::waiters::{Kind, Waiter};
use crate::backend::{Appended, Attempt, Mode, Op};
use crate::lock::acquire_until;
use crate::{
    Backoff, ConfigError, LockClient, LockConfig, LockError, LockGuard, LockName, LossReason, Token,
};

/// The largest part (or whole record) [`OnceGuard::append`] and [`OnceGuard::complete`] accept:
/// 512 MiB, the largest string Redis accepts. Larger ones are refused with
/// [`LockError::TooLarge`] before anything is sent.
///
/// ```
/// assert_eq!(distlock::once::MAX_PART_LEN, 512 << 20);
/// ```
pub const MAX_PART_LEN: usize = 512 << 20;

/// A completed record, as [`Once::begin`] finds it: its first part and how many parts it has.
/// A record completed without appends (the whole record in one [`OnceGuard::complete`]) is one
/// part; read the others of a streamed record with [`Once::parts`] or [`Once::follow`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::Begin;
/// let once = distlock::LockClient::memory().once("evt")?;
/// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
/// guard.complete(b"whole").await?;
/// let Begin::Done(record) = once.begin("").await? else { unreachable!() };
/// assert_eq!(record.parts(), 1);
/// assert_eq!(record.whole().map(|b| &b[..]), Some(&b"whole"[..]));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    first: Bytes,
    parts: u64,
}

impl Record {
    pub(crate) fn new(first: Bytes, parts: u64) -> Self {
        Record { first, parts }
    }

    /// A one-part record, as a cache of completed records kept beside the store holds it (the
    /// bytes a [`complete`](OnceGuard::complete) stored).
    ///
    /// ```
    /// let record = distlock::once::Record::one_part(bytes::Bytes::from_static(b"ok"));
    /// assert_eq!(record.parts(), 1);
    /// assert_eq!(record.whole().map(|b| &b[..]), Some(&b"ok"[..]));
    /// ```
    pub fn one_part(first: Bytes) -> Self {
        Record { first, parts: 1 }
    }

    /// The first part (the whole record when it has one part).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// # let once = distlock::LockClient::memory().once("evt")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// guard.append(b"head").await?;
    /// guard.complete(b"tail").await?;
    /// let Begin::Done(record) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(&record.first()[..], b"head");
    /// # Ok(()) }
    /// ```
    pub fn first(&self) -> &Bytes {
        &self.first
    }

    /// The first part, by value.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// # let once = distlock::LockClient::memory().once("evt")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// guard.complete(b"rec").await?;
    /// let Begin::Done(record) = once.begin("").await? else { unreachable!() };
    /// let bytes: bytes::Bytes = record.into_first();
    /// assert_eq!(&bytes[..], b"rec");
    /// # Ok(()) }
    /// ```
    pub fn into_first(self) -> Bytes {
        self.first
    }

    /// How many parts the record has (at least 1).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// # let once = distlock::LockClient::memory().once("evt")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// guard.append(b"a").await?;
    /// guard.append(b"b").await?;
    /// guard.complete(b"c").await?;
    /// let Begin::Done(record) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(record.parts(), 3);
    /// # Ok(()) }
    /// ```
    pub fn parts(&self) -> u64 {
        self.parts
    }

    /// The whole record, if it is one part; `None` for a streamed record of several parts.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// # let once = distlock::LockClient::memory().once("evt")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// guard.append(b"a").await?;
    /// guard.complete(b"b").await?;
    /// let Begin::Done(record) = once.begin("").await? else { unreachable!() };
    /// assert!(record.whole().is_none(), "two parts: read them with Once::parts");
    /// # Ok(()) }
    /// ```
    pub fn whole(&self) -> Option<&Bytes> {
        (self.parts == 1).then_some(&self.first)
    }
}

/// What the store holds for a run-once name, read without changing it: see [`Once::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The holder, while a lease holds the name.
    pub holder: Option<Holder>,
    /// The completed record: its first part, and how many parts it has.
    pub record: Option<Record>,
    /// The last fencing token handed out for the name (the holder's, or the last holder's).
    pub fence: Option<u64>,
    /// How much longer the record (and the fencing counter) is kept.
    pub expires_in: Option<Duration>,
}

impl Inspection {
    /// Nothing is stored for the name.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("never-used")?;
    /// assert!(once.inspect().await?.is_absent());
    /// # Ok(()) }
    /// ```
    pub fn is_absent(&self) -> bool {
        self.holder.is_none() && self.record.is_none() && self.fence.is_none()
    }
}

/// The holder of a run-once name, as [`Once::inspect`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The lease left (`None`: a lease without an expiry, which this crate never sets).
    pub lease_left: Option<Duration>,
    /// The holder's fencing token.
    pub fence: u64,
    /// The tag the holder passed to [`Once::begin`].
    pub tag: Bytes,
    /// When the holder took the name, by its own clock (`None` when the store did not say: a
    /// holder of an earlier version).
    pub since: Option<std::time::SystemTime>,
}

/// What [`Once::purge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Purged {
    /// The record (and the fencing counter) were deleted.
    Deleted,
    /// Nothing was stored.
    Absent,
    /// A lease holds the name: nothing was deleted, the holder is left alone (purge again once
    /// it has ended).
    InFlight {
        /// The holder's lease left.
        lease_left: Option<Duration>,
    },
}

/// Where a run-once record stands, as [`Once::parts`] reads it.
///
/// ```
/// use distlock::once::RecordState;
/// fn finished(state: RecordState, read: u64) -> Option<Result<(), &'static str>> {
///     match state {
///         RecordState::Done { parts } if read == parts => Some(Ok(())),
///         RecordState::Abandoned => Some(Err("the writer is gone: the record is incomplete")),
///         _ => None, // more to read, or to wait for
///     }
/// }
/// assert_eq!(finished(RecordState::Done { parts: 2 }, 2), Some(Ok(())));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// A holder is alive and writing; it appended `parts` parts so far.
    Writing {
        /// Parts appended so far.
        parts: u64,
    },
    /// The record is complete with `parts` parts.
    Done {
        /// Parts of the complete record (at least 1).
        parts: u64,
    },
    /// No holder and no record: nobody began, or the writer died, aborted or lost its lease.
    /// What it wrote is not a record: report an error, never present it as complete.
    Abandoned,
}

/// Parts of a run-once record and its state, read in one atomic step ([`Once::parts`],
/// [`Once::wait_parts`], [`Follower::next`]).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::{Begin, once::RecordState};
/// let once = distlock::LockClient::memory().once("export")?;
/// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
/// guard.append(b"a").await?;
/// let read = once.parts(0, 16).await?;
/// assert_eq!(read.parts(), [bytes::Bytes::from_static(b"a")]);
/// assert_eq!(read.state(), RecordState::Writing { parts: 1 });
/// assert_eq!(read.fence(), guard.fence());
/// assert_eq!(read.next(), 1);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Parts {
    from: u64,
    parts: Vec<Bytes>,
    fence: u64,
    state: RecordState,
    /// The writer's remaining lease (while writing): a waiting reader looks again when it ends,
    /// since a writer that dies announces nothing.
    lease_left: Option<Duration>,
}

impl Parts {
    pub(crate) fn new(
        from: u64,
        parts: Vec<Bytes>,
        fence: u64,
        state: RecordState,
        lease_left: Option<Duration>,
    ) -> Self {
        Parts {
            from,
            parts,
            fence,
            state,
            lease_left,
        }
    }

    /// The index of the first part returned.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("k")?;
    /// assert_eq!(once.parts(3, 1).await?.from(), 3);
    /// # Ok(()) }
    /// ```
    pub fn from(&self) -> u64 {
        self.from
    }

    /// The parts read, from [`from`](Parts::from) on, in order.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("k")?;
    /// assert!(once.parts(0, 8).await?.parts().is_empty(), "nothing written");
    /// # Ok(()) }
    /// ```
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// The parts read, by value.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("k")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// # guard.complete(b"r").await?;
    /// let parts: Vec<bytes::Bytes> = once.parts(0, 8).await?.into_parts();
    /// assert_eq!(parts.len(), 1);
    /// # Ok(()) }
    /// ```
    pub fn into_parts(self) -> Vec<Bytes> {
        self.parts
    }

    /// The index after the last part read: where the next read starts.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("k")?;
    /// assert_eq!(once.parts(5, 8).await?.next(), 5);
    /// # Ok(()) }
    /// ```
    pub fn next(&self) -> u64 {
        self.from.saturating_add(self.parts.len() as u64)
    }

    /// The fencing token of the record's writer (the current holder while it writes): a reader
    /// that sees it change knows a new writer started over, and must not mix their parts.
    /// [`Follower`] checks it for you.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("k")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(once.parts(0, 1).await?.fence(), guard.fence());
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// Where the record stands.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("k")?;
    /// let state = once.parts(0, 1).await?.state();
    /// assert_eq!(state, distlock::once::RecordState::Abandoned, "nobody writes it");
    /// # Ok(()) }
    /// ```
    pub fn state(&self) -> RecordState {
        self.state
    }

    /// Whether the record is done and these parts reach its end.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// # use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("k")?;
    /// # let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// guard.append(b"a").await?;
    /// guard.complete(b"b").await?;
    /// assert!(!once.parts(0, 1).await?.is_complete());
    /// assert!(once.parts(1, 1).await?.is_complete());
    /// # Ok(()) }
    /// ```
    pub fn is_complete(&self) -> bool {
        matches!(self.state, RecordState::Done { parts } if self.next() >= parts)
    }

    /// Whether there is nothing to wait for at `from`: parts from there on exist, or no holder
    /// is writing any more.
    fn ready(&self, from: u64) -> bool {
        match self.state {
            RecordState::Writing { parts } => parts > from,
            _ => true,
        }
    }
}

/// A run-once lock on one name. See the [module docs](crate::once).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::Begin;
/// let client = distlock::LockClient::memory();
/// let once = client.once("payment-evt_123")?;
///
/// let Begin::Acquired(guard) = once.begin("fingerprint-A").await? else { unreachable!() };
/// // apply the payment, fenced with guard.fence() ...
/// guard.complete(b"201 Created").await?;
///
/// match once.begin("fingerprint-A").await? {
///     Begin::Done(record) => assert_eq!(&record.first()[..], b"201 Created"),
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Once {
    client: LockClient,
    name: LockName,
    /// The retention, if set with [`Once::retention`]; else the default (at least the lease).
    retention: Option<Duration>,
    config: Arc<LockConfig>,
}

/// The default record retention, raised to the lease when that is longer.
const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// What [`Once::begin`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin {
    /// Nobody completed the work and nobody is doing it: it is ours to do.
    Acquired(OnceGuard),
    /// The work was completed; this is the stored record (its first part, and how many parts
    /// it has: one unless it was streamed with [`OnceGuard::append`]).
    Done(Record),
    /// Someone holds the lock and is doing the work.
    #[non_exhaustive]
    InFlight {
        /// The tag the holder passed to `begin`.
        tag: Bytes,
        /// The holder's remaining lease, if known.
        retry_after: Option<Duration>,
        /// The holder's fencing token: tells writers apart (see [`Parts::fence`]).
        fence: u64,
        /// How many parts the holder appended so far: above zero, the record is being streamed
        /// and can be followed live ([`Once::follow`]).
        parts: u64,
    },
}

impl Once {
    pub(crate) fn new(client: LockClient, name: LockName) -> Self {
        let config = client.shared_config();
        Once {
            client,
            name,
            retention: None,
            config,
        }
    }

    /// How long a completion record is kept (default 24 hours, or the lease if longer). It must
    /// be at least the lease.
    ///
    /// ```
    /// use std::time::Duration;
    /// let once = distlock::LockClient::memory().once("k")?.retention(Duration::from_secs(3600))?;
    /// assert_eq!(once.retention_period(), Duration::from_secs(3600));
    /// # Ok::<(), distlock::ConfigError>(())
    /// ```
    pub fn retention(mut self, retention: Duration) -> Result<Self, ConfigError> {
        if retention > crate::config::MAX_TTL {
            return Err(ConfigError::invalid(
                "retention",
                format!(
                    "{retention:?} is above the longest expiry accepted ({:?})",
                    crate::config::MAX_TTL
                ),
            ));
        }
        if retention < self.config.lease() {
            return Err(ConfigError::invalid(
                "retention",
                format!(
                    "{retention:?} is shorter than the lease {:?}: the state could expire while the work runs",
                    self.config.lease()
                ),
            ));
        }
        self.retention = Some(retention);
        Ok(self)
    }

    /// The record retention.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.retention_period(), std::time::Duration::from_secs(86_400));
    /// ```
    pub fn retention_period(&self) -> Duration {
        self.retention
            .unwrap_or_else(|| DEFAULT_RETENTION.max(self.config.lease()))
    }

    /// The same run-once lock with other timing (the retention must still cover the lease).
    ///
    /// ```
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// let config = distlock::LockConfig::builder().lease(Duration::from_secs(5)).build()?;
    /// let once = distlock::LockClient::memory().once("k")?.with_config(config)?;
    /// # Ok(()) }
    /// ```
    pub fn with_config(mut self, config: LockConfig) -> Result<Self, ConfigError> {
        self.client.backend().check_config(&config)?;
        self.config = Arc::new(config);
        match self.retention {
            Some(retention) => self.retention(retention),
            None => Ok(self),
        }
    }

    /// The name and keys.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.name().as_str(), "k");
    /// ```
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// One atomic step: the stored record, or the lock, or who holds it.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("signup:+15550100")?;
    /// let first = once.begin("fp").await?;
    /// assert!(matches!(first, Begin::Acquired(_)));
    /// match once.begin("other-fp").await? {
    ///     Begin::InFlight { tag, .. } => assert_eq!(&tag[..], b"fp"),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self, tag: impl Into<Bytes>) -> Result<Begin, LockError> {
        self.begin_with(tag.into(), None, false).await
    }

    /// Like [`begin`](Once::begin), but while someone is in flight waits up to `wait` (woken by
    /// their release) for the record, or for the lock if they gave up without completing.
    /// Returns `InFlight` if they are still at it when `wait` ends, or as soon as they appended
    /// their first part (`InFlight` with `parts > 0`): a streamed record can be followed live
    /// ([`Once::follow`]) instead of waited for.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("evt_1")?;
    /// let Begin::Acquired(guard) = once.begin("fp").await? else { unreachable!() };
    /// let waiting = tokio::spawn({
    ///     let once = once.clone();
    ///     async move { once.begin_wait("fp", Duration::from_secs(5)).await }
    /// });
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// guard.complete(b"done").await?;
    /// assert!(matches!(waiting.await.unwrap()?, Begin::Done(r) if &r.first()[..] == b"done"));
    /// # Ok(()) }
    /// ```
    pub async fn begin_wait(
        &self,
        tag: impl Into<Bytes>,
        wait: Duration,
    ) -> Result<Begin, LockError> {
        self.begin_with(tag.into(), Some(wait), true).await
    }

    /// Like [`begin_wait`](Once::begin_wait), but waits through a streamed record's parts for
    /// its end: returns `Done` (or `Acquired`, if they gave up) as soon as it is there, and
    /// `InFlight` only when `wait` ends first. For a caller that answers with complete records
    /// only (a duplicate that arrives while the record's last part and completion are on their
    /// way must get the record, not "in flight").
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::Duration;
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("evt_2")?;
    /// let Begin::Acquired(guard) = once.begin("fp").await? else { unreachable!() };
    /// guard.append(b"head").await?;
    /// let waiting = tokio::spawn({
    ///     let once = once.clone();
    ///     async move { once.begin_wait_done("fp", Duration::from_secs(5)).await }
    /// });
    /// tokio::time::sleep(Duration::from_millis(20)).await;
    /// guard.complete(b"end").await?;
    /// assert!(matches!(waiting.await.unwrap()?, Begin::Done(r) if r.parts() == 2));
    /// # Ok(()) }
    /// ```
    pub async fn begin_wait_done(
        &self,
        tag: impl Into<Bytes>,
        wait: Duration,
    ) -> Result<Begin, LockError> {
        self.begin_with(tag.into(), Some(wait), false).await
    }

    /// Begins, waiting up to `wait` (if any) while someone is in flight; `follow`: whether
    /// their first part ends the wait.
    async fn begin_with(
        &self,
        tag: Bytes,
        wait: Option<Duration>,
        follow: bool,
    ) -> Result<Begin, LockError> {
        let deadline = wait.map(|wait| crate::clock::after(crate::clock::now(), wait));
        let mut op = Op {
            name: self.name.clone(),
            token: Token::random(),
            lease: self.config.lease(),
            drift: self.config.drift(),
            fencing: self.config.fencing(),
            state_ttl: None,
            mode: Mode::Once {
                tag,
                retention: self.retention_period(),
            },
        };
        let backend = self.client.backend();
        let (attempt, sent) =
            acquire_until(backend, &mut op, &self.config, deadline, follow).await?;
        Ok(match attempt {
            Attempt::Acquired { fence } => Begin::Acquired(OnceGuard {
                guard: LockGuard::start(
                    self.client.watchdog(),
                    backend.clone(),
                    op,
                    self.config.clone(),
                    fence,
                    sent,
                ),
                appended: AtomicU64::new(0),
                appending: tokio::sync::Mutex::new(()),
            }),
            Attempt::Done { record } => Begin::Done(record),
            Attempt::Held {
                ttl,
                tag,
                fence,
                parts,
            } => Begin::InFlight {
                tag: tag.unwrap_or_default(),
                retry_after: ttl,
                fence,
                parts,
            },
        })
    }

    /// Up to `max` parts of the record from part `from` on (0-based), with its state and its
    /// writer's fence, in one atomic read (one round trip on Redis). Works on the record being
    /// written and on a completed one (a one-part record is its part 0).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached (a read that fails for want of
    /// the store is tried again, with backoff, for up to the command timeout from the first
    /// failure); [`LockError::Unsupported`] on Redlock; [`LockError::BrokenRecord`] if a part
    /// of a completed record is missing.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::{Begin, once::RecordState};
    /// let once = distlock::LockClient::memory().once("export")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// for part in [&b"a"[..], b"b", b"c"] {
    ///     guard.append(part).await?;
    /// }
    /// guard.complete(b"d").await?;
    /// let read = once.parts(1, 2).await?;
    /// assert_eq!(read.parts(), [&b"b"[..], &b"c"[..]]);
    /// assert_eq!(read.state(), RecordState::Done { parts: 4 });
    /// # Ok(()) }
    /// ```
    pub async fn parts(&self, from: u64, max: usize) -> Result<Parts, LockError> {
        self.read(|| self.client.backend().parts(&self.name, from, max))
            .await
    }

    /// Up to `max` parts of a completed record from part `from` on, read without its state:
    /// one plain list read on Redis, where [`parts`](Once::parts) runs a script (which copies
    /// every part into Lua and back: for 64 KiB parts that costs Redis about five times the
    /// read itself). Only for a record already seen [`Done`](RecordState::Done) (with its part
    /// count and its writer's fence), whose parts never change while it lives.
    ///
    /// It returns what the store holds from `from` on, up to `max`: fewer parts than asked for
    /// when the record has fewer, or when parts are missing (a caller that knows the part count
    /// checks that it got them all). When the list read finds nothing, it is
    /// [`parts`](Once::parts) (a second round trip): a one-part record is its part 0, a
    /// completed record missing its parts is an error. The list is read where the client's
    /// connection sends reads (a connection of your own that reads from replicas may see a
    /// replica behind the primary).
    ///
    /// Nothing here tells the record seen done from one begun again under the same name after
    /// it expired: a caller reading across that must recognise its own parts. The fences of a
    /// record begun again keep increasing (its new counter starts from the writer's clock, in
    /// microseconds), so parts bound to their writer's fence, as the HTTP layer seals them, tell.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached (tried again as
    /// [`parts`](Once::parts) is); [`LockError::Unsupported`] on Redlock; from the fallback,
    /// [`LockError::BrokenRecord`] for a completed record whose parts are gone.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("export")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// for part in [&b"a"[..], b"b", b"c"] {
    ///     guard.append(part).await?;
    /// }
    /// guard.complete(b"d").await?;
    /// assert_eq!(once.stored_parts(1, 2).await?, [&b"b"[..], &b"c"[..]]);
    /// # Ok(()) }
    /// ```
    pub async fn stored_parts(&self, from: u64, max: usize) -> Result<Vec<Bytes>, LockError> {
        self.read(|| self.client.backend().stored_parts(&self.name, from, max))
            .await
    }

    /// What the store holds for this name, read without changing it (one round trip on
    /// Redis): the holder, while a lease holds it; the completed record; the fencing counter
    /// and how long the state is kept. For operators (see also [`Once::purge`] and
    /// [`LockClient::scan`](crate::LockClient::scan)).
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached; [`LockError::Unsupported`]
    /// on Redlock (a read of one master would not be the quorum's).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("order-7")?;
    /// let Begin::Acquired(guard) = once.begin("fp").await? else { unreachable!() };
    /// let held = once.inspect().await?;
    /// assert_eq!(held.holder.as_ref().map(|h| h.fence), Some(guard.fence()));
    /// guard.complete(b"paid").await?;
    /// let done = once.inspect().await?;
    /// assert!(done.holder.is_none());
    /// assert_eq!(done.record.map(|r| r.into_first()), Some(bytes::Bytes::from_static(b"paid")));
    /// # Ok(()) }
    /// ```
    pub async fn inspect(&self) -> Result<Inspection, LockError> {
        self.read(|| self.client.backend().inspect(&self.name))
            .await
    }

    /// Deletes this name's record, so that the next [`begin`](Once::begin) runs the work
    /// again: for an operator who has reconciled an outcome by hand. Never while a lease holds
    /// the name ([`Purged::InFlight`], nothing deleted): a second execution never starts beside
    /// the one running.
    ///
    /// # Errors
    /// [`LockError::Unavailable`] if the store cannot be reached; [`LockError::Unsupported`]
    /// on Redlock.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use distlock::{Begin, once::Purged};
    /// let once = distlock::LockClient::memory().once("order-7")?;
    /// let Begin::Acquired(guard) = once.begin("fp").await? else { unreachable!() };
    /// assert!(matches!(once.purge().await?, Purged::InFlight { .. }));
    /// guard.complete(b"paid").await?;
    /// assert_eq!(once.purge().await?, Purged::Deleted);
    /// assert!(matches!(once.begin("fp").await?, Begin::Acquired(_)));
    /// # Ok(()) }
    /// ```
    pub async fn purge(&self) -> Result<Purged, LockError> {
        crate::backend::timed(
            self.config.op_timeout(),
            self.client.backend().purge(&self.name),
        )
        .await
        .unwrap_or_else(|_| {
            Err(LockError::timeout(
                self.name.as_str(),
                true,
                self.config.op_timeout(),
            ))
        })
    }

    /// Runs a read (which changes nothing, so it may run twice) until it answers, trying again
    /// while the store is out of reach ([`LockError::is_unavailable`]: a dropped connection, a
    /// failover) with backoff, for up to the command timeout from the first failure (counted
    /// when it is seen: a read nobody polls for a while, a replay's read-ahead behind a slow
    /// client, still gets its tries); each try has the whole command timeout. A store that
    /// does not answer within it is not tried again.
    async fn read<T, Fut>(&self, mut read: impl FnMut() -> Fut) -> Result<T, LockError>
    where
        Fut: Future<Output = Result<T, LockError>>,
    {
        let timeout = self.config.op_timeout();
        let mut backoff = Backoff::new(self.config.retry_base(), self.config.retry_max());
        let mut retry_until = None;
        loop {
            let error = match crate::backend::timed(timeout, read()).await {
                Ok(Ok(read)) => return Ok(read),
                Ok(Err(error)) => error,
                Err(_) => return Err(LockError::timeout(self.name.as_str(), false, timeout)),
            };
            let now = crate::clock::now();
            let until = *retry_until.get_or_insert_with(|| crate::clock::after(now, timeout));
            let delay = backoff.next_delay();
            if !error.is_unavailable() || crate::clock::after(now, delay) >= until {
                return Err(error);
            }
            tracing::debug!(lock = self.name.as_str(), %error, "a read failed; trying again");
            tokio::time::sleep(delay).await;
        }
    }

    /// Like [`parts`](Once::parts), but while the holder is alive and has not appended part
    /// `from` yet, waits (until `until`) for it: returns as soon as parts from `from` on exist
    /// or the record is no longer being written ([`RecordState::Done`] or
    /// [`RecordState::Abandoned`]), else at `until` with what there is (no parts, `Writing`).
    /// Woken by the writer's announcements (every waiting reader wakes), with polling as the
    /// fallback ([`LockConfigBuilder::polling`](crate::LockConfigBuilder::polling)) and a look
    /// at the end of the writer's lease (a dead writer announces nothing).
    ///
    /// If the writer changed during the wait (a new holder started over) this reports
    /// `Abandoned` for the writer first seen. To read a whole stream, [`Once::follow`] keeps its
    /// subscription and place between calls.
    ///
    /// # Errors
    /// As [`parts`](Once::parts).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::{Duration, Instant};
    /// use distlock::Begin;
    /// let once = distlock::LockClient::memory().once("export")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// let reader = tokio::spawn({
    ///     let once = once.clone();
    ///     async move { once.wait_parts(0, 16, Instant::now() + Duration::from_secs(5)).await }
    /// });
    /// guard.append(b"first").await?;
    /// assert_eq!(reader.await.unwrap()?.parts(), [&b"first"[..]]);
    /// # Ok(()) }
    /// ```
    pub async fn wait_parts(
        &self,
        from: u64,
        max: usize,
        until: Instant,
    ) -> Result<Parts, LockError> {
        self.follow(from).next(max, until).await
    }

    /// A reader of this record from part `from` on: each [`Follower::next`] returns the parts
    /// that follow the last ones it returned, waiting for them while the holder writes. It keeps
    /// one subscription for its lifetime and sticks to one writer (see [`Follower::next`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::{Duration, Instant};
    /// use distlock::{Begin, once::RecordState};
    /// let once = distlock::LockClient::memory().once("tokens")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// type Error = Box<dyn std::error::Error + Send + Sync>;
    /// let reader = tokio::spawn({
    ///     let mut follower = once.follow(0);
    ///     async move {
    ///         let mut body = Vec::new();
    ///         loop {
    ///             let until = Instant::now() + Duration::from_secs(5);
    ///             let read = follower.next(16, until).await?;
    ///             read.parts().iter().for_each(|p| body.extend_from_slice(p));
    ///             match read.state() {
    ///                 _ if read.is_complete() => return Ok::<_, Error>(body),
    ///                 RecordState::Abandoned => return Err("the writer is gone".into()),
    ///                 _ => continue, // more to come, or more to read
    ///             }
    ///         }
    ///     }
    /// });
    /// guard.append(b"Hello, ").await?;
    /// guard.complete(b"world").await?;
    /// assert_eq!(reader.await.unwrap().unwrap(), b"Hello, world");
    /// # Ok(()) }
    /// ```
    pub fn follow(&self, from: u64) -> Follower {
        Follower {
            once: self.clone(),
            next: from,
            writer: None,
            seen: 0,
            waiter: None,
        }
    }
}

/// A reader of a run-once record that follows it part by part while it is written (see
/// [`Once::follow`]).
///
/// It sticks to one writer: the first writer it sees (or the one given to
/// [`expect_writer`](Follower::expect_writer), for example the fence of
/// [`Begin::InFlight`]). If the store shows another writer (the first one died or lost its
/// lease and a new holder started over), it reports [`RecordState::Abandoned`] with the first
/// writer's fence and no parts: parts of two writers are never mixed.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// let once = distlock::LockClient::memory().once("k")?;
/// let follower = once.follow(0).expect_writer(7);
/// assert_eq!(follower.writer(), Some(7));
/// assert_eq!(follower.position(), 0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Follower {
    once: Once,
    next: u64,
    writer: Option<u64>,
    /// The most parts the writer followed was seen holding: its parts only grow.
    seen: u64,
    /// Registered at the first wait, kept until dropped.
    waiter: Option<Waiter>,
}

impl Follower {
    /// Follows only the writer with this fencing token.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.follow(0).expect_writer(3).writer(), Some(3));
    /// ```
    #[must_use]
    pub fn expect_writer(mut self, fence: u64) -> Self {
        self.writer = Some(fence);
        self
    }

    /// The fencing token of the writer followed, once known.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.follow(0).writer(), None);
    /// ```
    pub fn writer(&self) -> Option<u64> {
        self.writer
    }

    /// The index of the next part to read.
    ///
    /// ```
    /// let once = distlock::LockClient::memory().once("k").unwrap();
    /// assert_eq!(once.follow(4).position(), 4);
    /// ```
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Up to `max` parts from the current position on; while the holder writes and has not
    /// appended the next part yet, waits for it until `until` (see [`Once::wait_parts`]).
    /// Advances past the parts returned.
    ///
    /// # Errors
    /// As [`Once::parts`], and [`LockError::BrokenRecord`] when the record being written holds
    /// fewer parts than this follower saw it hold (parts lost: evicted, deleted).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// use std::time::{Duration, Instant};
    /// use distlock::{Begin, once::RecordState};
    /// let once = distlock::LockClient::memory().once("k")?;
    /// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
    /// let mut follower = once.follow(0);
    /// let soon = Instant::now() + Duration::from_millis(20);
    /// let read = follower.next(8, soon).await?;
    /// assert!(read.parts().is_empty(), "nothing yet, the deadline passed");
    /// assert_eq!(read.state(), RecordState::Writing { parts: 0 });
    /// guard.append(b"x").await?;
    /// assert_eq!(follower.next(8, soon).await?.parts(), [&b"x"[..]]);
    /// assert_eq!(follower.position(), 1);
    /// # Ok(()) }
    /// ```
    pub async fn next(&mut self, max: usize, until: Instant) -> Result<Parts, LockError> {
        let config = self.once.config.clone();
        let mut backoff = Backoff::new(config.retry_base(), config.retry_max());
        loop {
            if let Some(waiter) = &mut self.waiter {
                // Before looking: an announcement made while we look wakes the wait below.
                waiter.mark_seen();
            }
            let read = self.pinned(self.once.parts(self.next, max).await?);
            // The writer followed holds fewer parts than it was seen holding: a writer's parts
            // only grow, so some were lost (evicted under `maxmemory`, deleted), and its next
            // append will be refused. Said at once, not waited out until the writer's run ends.
            // (Fewer than the position alone is a reader that started ahead: it waits.)
            if let RecordState::Writing { parts } = read.state {
                if parts < self.seen {
                    return Err(LockError::broken(
                        self.once.name.as_str(),
                        format!(
                            "the record being written holds {parts} parts, {} before: parts lost",
                            self.seen
                        ),
                    ));
                }
                self.seen = parts;
            }
            let now = crate::clock::now();
            if read.ready(self.next) || now >= until {
                self.next = read.next();
                return Ok(read);
            }
            let left = until - now;
            match &mut self.waiter {
                None => {
                    // Subscribe, then look again: what was announced before the subscription
                    // was not heard.
                    let backend = self.once.client.backend();
                    let mut waiter = backend
                        .waiters()
                        .register_as(self.once.name.channel(), Kind::Reader);
                    waiter.subscribed(config.op_timeout().min(left)).await;
                    self.waiter = Some(waiter);
                }
                Some(waiter) => {
                    let mut delay = if config.polling() {
                        backoff.next_delay().min(left)
                    } else {
                        left
                    };
                    if let Some(lease) = read.lease_left {
                        // A writer that dies announces nothing: look when its lease ends.
                        delay = delay.min(lease + Duration::from_millis(1));
                    }
                    tokio::select! {
                        () = waiter.progressed() => {}
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// `read`, unless it is another writer's: then `Abandoned` for ours.
    fn pinned(&mut self, read: Parts) -> Parts {
        if read.state == RecordState::Abandoned {
            return read;
        }
        match self.writer {
            None => {
                self.writer = Some(read.fence);
                read
            }
            Some(fence) if fence == read.fence => read,
            Some(fence) => Parts::new(read.from, Vec::new(), fence, RecordState::Abandoned, None),
        }
    }
}

/// Runs `call` until it succeeds, retrying transient failures (a dropped connection, a
/// failover) while the guard's lease can still be proven held; each try is bounded by the
/// command timeout. Only for calls the store recognises when repeated (completion, append).
async fn within_lease<T, F, Fut>(guard: &LockGuard, what: &str, mut call: F) -> Result<T, LockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, LockError>>,
{
    let config = guard.config();
    let lease = guard.lease();
    let mut backoff = Backoff::new(config.retry_base(), config.retry_max());
    loop {
        let error = match crate::backend::timed(config.op_timeout(), call()).await {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(error)) => error.into_ambiguous(),
            Err(_) => LockError::timeout(guard.name(), true, config.op_timeout()),
        };
        if !(error.is_unavailable() && lease.is_held()) {
            return Err(error);
        }
        tracing::debug!(lock = guard.name(), %error, "{what} failed; retrying within the lease");
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Refuses a part no store accepts.
fn check_part(name: &str, part: &[u8]) -> Result<(), LockError> {
    if part.len() > MAX_PART_LEN {
        return Err(LockError::TooLarge {
            name: name.to_owned(),
            len: part.len(),
            max: MAX_PART_LEN,
        });
    }
    Ok(())
}

/// The holder of a run-once lock. [`complete`](OnceGuard::complete) stores the record and
/// releases; dropping it (error, panic, cancellation) releases without a record, so a retry does
/// the work again. [`append`](OnceGuard::append) streams the record part by part before it is
/// complete (readers follow it live); dropping or aborting after appends deletes the parts.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::LockError> {
/// use distlock::Begin;
/// let once = distlock::LockClient::memory().once("job")?;
/// let Begin::Acquired(guard) = once.begin("").await? else { unreachable!() };
/// assert!(guard.abort().await?);
/// assert!(matches!(once.begin("").await?, Begin::Acquired(_)), "no record: do it again");
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping the guard releases the lock without a record"]
pub struct OnceGuard {
    guard: LockGuard,
    /// Parts stored so far: the index of the next one.
    appended: AtomicU64,
    /// One append at a time, in the order they were called.
    appending: tokio::sync::Mutex<()>,
}

impl OnceGuard {
    /// The underlying lock guard: fence, lease, loss signal.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.guard().fence(), 1);
    /// # Ok(()) }
    /// ```
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// The fencing token of this attempt.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.fence(), g.guard().fence());
    /// # Ok(()) }
    /// ```
    pub fn fence(&self) -> u64 {
        self.guard.fence()
    }

    /// How many parts [`append`](OnceGuard::append) stored so far.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.appended(), 0);
    /// g.append(b"part").await?;
    /// assert_eq!(g.appended(), 1);
    /// # Ok(()) }
    /// ```
    pub fn appended(&self) -> u64 {
        self.appended.load(Ordering::Acquire)
    }

    /// Appends the next part of the record and returns its index (0-based), atomically, only if
    /// the lock is still ours; refreshes the retention of every key of the record and wakes its
    /// readers ([`Once::follow`], [`Once::wait_parts`], and a [`Once::begin_wait`] that waits
    /// for the first part). Appends run one at a time, in call order.
    ///
    /// Idempotent: the store is told the index of the part, and a retry of an append that
    /// happened (its reply was lost) is recognised, so a part is never stored twice. A
    /// transient failure is retried while the lease can be proven held, as for
    /// [`complete`](OnceGuard::complete). An append whose future was dropped mid-flight may or
    /// may not have happened: appending the same part again is recognised; another part at
    /// that index is refused with [`LockError::BrokenRecord`].
    ///
    /// # Errors
    /// [`LockError::LeaseLost`] if the lock is not ours any more (nothing appended);
    /// [`LockError::Unavailable`] if the store could not be reached within the lease (the
    /// part may or may not be stored: appending it again is recognised);
    /// [`LockError::TooLarge`] above [`MAX_PART_LEN`]; [`LockError::Capacity`] when the
    /// in-memory store is full; [`LockError::BrokenRecord`] if the stored parts are not the
    /// ones appended (a part evicted or deleted behind the record's back);
    /// [`LockError::Unsupported`] on Redlock ([`LockClient::supports_streaming`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("export")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(g.append(b"HTTP/1.1 200 OK").await?, 0);
    /// assert_eq!(g.append(b"chunk").await?, 1);
    /// g.complete(b"end").await?;
    /// # Ok(()) }
    /// ```
    pub async fn append(&self, part: &[u8]) -> Result<u64, LockError> {
        let name = self.guard.name();
        check_part(name, part)?;
        let _turn = self.appending.lock().await;
        let index = self.appended();
        let (backend, op) = (self.guard.backend(), self.guard.op());
        let appended =
            within_lease(&self.guard, "append", || backend.append(op, index, part)).await?;
        match appended {
            Appended::Stored => {
                self.appended
                    .store(index.saturating_add(1), Ordering::Release);
                // Local readers at once; the store's announcement reaches the others.
                backend.waiters().progress(op.name.channel());
                Ok(index)
            }
            Appended::NotOwner => {
                self.guard.lease().shared().set_lost(LossReason::NotOwner);
                Err(LockError::LeaseLost {
                    name: name.to_owned(),
                    reason: LossReason::NotOwner,
                })
            }
            Appended::Mismatch { len } => Err(LockError::broken(
                name,
                format!(
                    "part {index} was to be appended, the store holds {len} parts and not this one at {index}"
                ),
            )),
        }
    }

    /// Stores the record and releases, atomically, only if the lock is still ours. Without
    /// earlier appends, `record` is the whole record (one part). After appends, `record` is the
    /// last part and the record is done with `appended() + 1` parts. A transient failure is
    /// retried while the lease can be proven held: a retry of a completion that did happen is
    /// recognised as such.
    ///
    /// # Errors
    /// [`LockError::LeaseLost`] if the lock was not ours any more (nothing stored: another
    /// holder may be doing the work); [`LockError::Unavailable`] if the store could not be
    /// reached within the lease (the guard is then released on drop; a record may or may not
    /// have been stored); [`LockError::TooLarge`] above [`LockClient::max_record_len`]
    /// ([`MAX_PART_LEN`], less on Redlock); [`LockError::BrokenRecord`] if parts appended before
    /// are missing from the store.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// g.complete(b"result").await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete(mut self, record: &[u8]) -> Result<(), LockError> {
        self.try_complete(record).await
    }

    /// Stores the record as [`complete`](Self::complete) does, but a completion the store
    /// refuses leaves this guard holding the lock: a record of parts the store no longer holds
    /// ([`LockError::BrokenRecord`]), a full in-memory store ([`LockError::Capacity`]), a record
    /// above [`LockClient::max_record_len`], a script error. The work is done, so the caller can still say so:
    /// store another record in its place ([`complete_whole`](Self::complete_whole)) rather than
    /// release the lock and let the work run again. After a completion that stored the record
    /// or found the lock lost, the guard is spent; after any other error (the store out of
    /// reach for the whole lease included) it still holds the lock, and dropping it releases.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(mut g) = once.begin("").await? else { unreachable!() };
    /// let huge = vec![0u8; distlock::once::MAX_PART_LEN + 1];
    /// assert!(g.try_complete(&huge).await.is_err(), "refused: the guard still holds the lock");
    /// g.complete_whole(b"done; the result was too large to keep").await?;
    /// # Ok(()) }
    /// ```
    pub async fn try_complete(&mut self, record: &[u8]) -> Result<(), LockError> {
        let appended = self.appended();
        self.complete_as(record, appended).await
    }

    /// Stores `record` as a one-part record in place of the parts appended so far (the store
    /// deletes them), and releases: what a writer whose streamed record broke (parts evicted
    /// behind its back) can still store, so that the work is not run again. Errors as
    /// [`complete`](Self::complete).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// g.append(b"part").await?;
    /// g.complete_whole(b"summary").await?;
    /// let distlock::Begin::Done(record) = once.begin("").await? else { unreachable!() };
    /// assert_eq!(record.whole().map(|r| &r[..]), Some(&b"summary"[..]));
    /// # Ok(()) }
    /// ```
    pub async fn complete_whole(mut self, record: &[u8]) -> Result<(), LockError> {
        self.complete_as(record, crate::backend::REPLACE_PARTS)
            .await
    }

    async fn complete_as(&mut self, record: &[u8], appended: u64) -> Result<(), LockError> {
        // The name is copied only into an error.
        check_part(self.guard.name(), record)?;
        let (backend, op) = (self.guard.backend(), self.guard.op());
        let max = backend.max_record_len(self.guard.config());
        if record.len() > max {
            return Err(LockError::TooLarge {
                name: self.guard.name().to_owned(),
                len: record.len(),
                max,
            });
        }
        let stored = within_lease(&self.guard, "completion", || {
            backend.complete(op, record, appended)
        })
        .await?;
        if stored {
            self.guard.disarm();
            crate::backend::wake_next(&**self.guard.backend(), self.guard.op());
            return Ok(());
        }
        self.guard.lease().shared().set_lost(LossReason::NotOwner);
        self.guard.disarm();
        Err(LockError::LeaseLost {
            name: self.guard.name().to_owned(),
            reason: LossReason::NotOwner,
        })
    }

    /// (Postgres, feature `postgres`) A transaction on a connection of the pool that holds this
    /// name's row locked until it ends: do the work's writes in it
    /// ([`Transaction::client`](crate::postgres::Transaction::client)), and the completion
    /// ([`complete`](Self::complete) and the others) stores the record in it and commits,
    /// so that the writes and the record commit together or not at all; [`abort`](Self::abort)
    /// (or dropping the guard) rolls it back. While it is open nobody else gets past the row
    /// lock: the lease is renewed in the transaction, and a process that dies takes the
    /// transaction and the row lock with its connection.
    ///
    /// # Errors
    /// [`LockError::Unsupported`] on another store; [`LockError::LeaseLost`] if the lease went
    /// before the row could be locked; [`LockError::Database`] if the database fails.
    #[cfg(feature = "postgres")]
    pub async fn transaction(&self) -> Result<crate::postgres::Transaction, LockError> {
        self.guard.backend().bind(self.guard.op()).await
    }

    /// Releases without storing a record (deleting the parts appended, if any); returns whether
    /// the lock was still ours.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), distlock::LockError> {
    /// let once = distlock::LockClient::memory().once("job")?;
    /// let distlock::Begin::Acquired(g) = once.begin("").await? else { unreachable!() };
    /// assert!(g.abort().await?);
    /// # Ok(()) }
    /// ```
    pub async fn abort(self) -> Result<bool, LockError> {
        self.guard.release().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client whose lease is longer than the default retention gets a retention as long as
    /// its lease (before: 24 hours whatever the lease, so the state of a record still being
    /// written could expire while its holder held the lock; `retention()` refused such a
    /// value, the default was never checked).
    #[test]
    fn the_default_retention_is_never_shorter_than_the_lease() {
        let lease = Duration::from_secs(30 * 3600);
        let config = LockConfig::builder()
            .lease(lease)
            .watchdog(false)
            .build()
            .unwrap();
        let client = LockClient::builder()
            .config(config)
            .memory(crate::MemoryLimits::default());
        let once = client.once("long").unwrap();
        assert!(
            once.retention_period() >= lease,
            "{:?} against a lease of {lease:?}",
            once.retention_period()
        );
        let short = LockClient::memory().once("short").unwrap();
        assert_eq!(short.retention_period(), Duration::from_secs(86_400));
    }

    /// A part (or whole record) above the limit is refused before anything is sent, with an
    /// error and no panic; the guard stays usable after a refused append.
    #[tokio::test]
    async fn parts_above_the_limit_are_refused() {
        let client = LockClient::memory();
        let once = client.once("big").unwrap();
        let Begin::Acquired(g) = once.begin("").await.unwrap() else {
            panic!("free")
        };
        // Zeroed and never touched: the pages are not really allocated.
        let huge = vec![0u8; MAX_PART_LEN + 1];
        match g.append(&huge).await {
            Err(LockError::TooLarge { len, max, .. }) => {
                assert_eq!((len, max), (MAX_PART_LEN + 1, MAX_PART_LEN));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(g.appended(), 0);
        assert_eq!(g.append(b"fine").await.unwrap(), 0);
        assert!(matches!(
            g.complete(&huge).await,
            Err(LockError::TooLarge { .. })
        ));
        drop(huge);
        assert!(client.settle(Duration::from_secs(5)).await);
        let Begin::Acquired(_) = once.begin("").await.unwrap() else {
            panic!("the refused completion released the lock, parts and all")
        };
        assert_eq!(
            once.parts(0, 8).await.unwrap().state(),
            RecordState::Writing { parts: 0 }
        );
    }
}
