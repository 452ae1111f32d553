//! The in-memory store: the same operations and semantics as the Redis scripts, for a single
//! process and for unit tests. Expired entries are swept on every operation; memory is bounded by
//! an entry count and a byte budget.
//!
//! **Fencing tokens** come from one counter for the whole store, not one per name: every
//! acquisition that fences takes the next value. A name's tokens are therefore strictly
//! increasing for as long as the store lives (they are no longer consecutive per name), and
//! nothing is kept per name for them: a lock name costs memory only while it is held (or while
//! a run-once record is kept), and no eviction or expiry can ever make a name's fence go back.
//! (Redis keeps a counter per name because there the counter must survive in the lock's own hash
//! slot; in one process a single counter is cheaper and stronger.)

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::waiters::Waiters;
use entries::Entries;

mod entries;
use super::{Appended, Attempt, Backend, BoxFuture, Mode, Op};
use crate::once::{self, Inspection, Parts, Purged, Record, RecordState};
use crate::{ConfigError, LockError, LockName, OwnerId, Token};

/// Bounds of the in-memory store.
///
/// When a new entry would exceed a bound, expired entries go first, then run-once state (records
/// kept for their retention, tags of locks no longer held) in order of expiry, with a warning;
/// held locks are never evicted. Fencing counters take no room (one counter serves the whole
/// store). If evicting cannot make the room (every entry is a held lock, or a record is larger
/// than what eviction could free) the operation fails with [`LockError::Capacity`], having
/// evicted nothing; and making room for a name never evicts that name's own state.
///
/// ```
/// let limits = distlock::MemoryLimits::new(10_000, 16 << 20)?;
/// assert_eq!(limits.max_entries(), 10_000);
/// # Ok::<(), distlock::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    max_entries: usize,
    max_bytes: usize,
}

impl Default for MemoryLimits {
    fn default() -> Self {
        MemoryLimits {
            max_entries: 100_000,
            max_bytes: 64 << 20,
        }
    }
}

impl MemoryLimits {
    /// At most `max_entries` locks and states together, and at most `max_bytes` of keys, tags,
    /// records and the parts of streamed records. Both must be above zero.
    ///
    /// A store takes the memory of its lookup table when it is made: 16 bytes per entry of
    /// twice `max_entries`, rounded up to a power of two, at most 16 MiB (4 MiB for the default
    /// 100,000 entries), written once then so that no request pays for mapping it.
    ///
    /// ```
    /// assert!(distlock::MemoryLimits::new(0, 1).is_err());
    /// ```
    pub fn new(max_entries: usize, max_bytes: usize) -> Result<Self, ConfigError> {
        if max_entries == 0 {
            return Err(ConfigError::invalid("max_entries", "must be above zero"));
        }
        if max_bytes == 0 {
            return Err(ConfigError::invalid("max_bytes", "must be above zero"));
        }
        Ok(MemoryLimits {
            max_entries,
            max_bytes,
        })
    }

    /// The entry bound.
    ///
    /// ```
    /// assert_eq!(distlock::MemoryLimits::default().max_entries(), 100_000);
    /// ```
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// The byte bound.
    ///
    /// ```
    /// assert_eq!(distlock::MemoryLimits::default().max_bytes(), 64 << 20);
    /// ```
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }
}

#[derive(Debug)]
enum Holder {
    Exclusive(Token),
    Reentrant {
        owner: OwnerId,
        holds: HashSet<Token>,
    },
}

#[derive(Debug)]
struct MemLock {
    holder: Holder,
    fence: u64,
    expires: Instant,
}

/// Run-once state: the holder's tag and the completion record, whole (one part) or streamed.
#[derive(Debug, Default)]
struct MemState {
    tag: Option<Bytes>,
    /// A record completed in one part.
    record: Option<Bytes>,
    /// The parts of a streamed record: being written (while held), or complete (`streamed`).
    parts: Vec<Bytes>,
    /// Bytes of `parts`.
    parts_bytes: usize,
    /// The part count of a complete streamed record.
    streamed: Option<u64>,
    /// The fence of the last holder (the writer of `parts` and of the record).
    writer: u64,
    /// The token that stored the record (a retried completion is recognised).
    completed_by: Option<Token>,
    expires: Option<Instant>,
    /// When the holder took the name, by the wall clock (for operators: `inspect`).
    since: Option<std::time::SystemTime>,
}

impl MemState {
    fn bytes(&self) -> usize {
        self.tag.as_ref().map_or(0, Bytes::len)
            + self.record.as_ref().map_or(0, Bytes::len)
            + self.parts_bytes
    }

    /// The completed record, if any: its first part and part count.
    fn done(&self) -> Option<Record> {
        if let Some(record) = &self.record {
            return Some(Record::new(record.clone(), 1));
        }
        let parts = self.streamed?;
        Some(Record::new(
            self.parts.first().cloned().unwrap_or_default(),
            parts,
        ))
    }

    fn push(&mut self, part: &[u8]) {
        self.parts_bytes += part.len();
        self.parts.push(Bytes::copy_from_slice(part));
    }

    fn clear_parts(&mut self) {
        self.parts = Vec::new();
        self.parts_bytes = 0;
    }
}

/// A lock and its state, under the lock key.
#[derive(Debug)]
struct Entry {
    /// The key the entry is stored under.
    key: Box<str>,
    /// Its hash in [`Entries`].
    hash: u64,
    lock: Option<MemLock>,
    state: Option<MemState>,
    /// Where the lock and the state stand in the store's indexes.
    indexed: Indexed,
}

/// An entry's places in the indexes: exactly one per lock and one per state, moved whenever an
/// expiry changes or a lock comes or goes (nothing stale is ever left behind to walk past).
#[derive(Debug, Default, Clone, Copy)]
struct Indexed {
    /// Its key in [`Store::locks`].
    lock: Option<At>,
    /// Its key in [`Store::idle`] (no lock) or [`Store::busy`] (under a lock).
    state: Option<(At, Place)>,
    /// What it counts for in [`Store::evictable`]: its slots and bytes while idle.
    evictable: (usize, usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Idle,
    Busy,
}

/// An index key: an expiry, and a sequence number that keeps equal expiries apart.
type At = (Instant, u64);

impl Entry {
    fn new(key: Box<str>, hash: u64) -> Self {
        Entry {
            key,
            hash,
            lock: None,
            state: None,
            indexed: Indexed::default(),
        }
    }

    fn live_lock(&self, now: Instant) -> Option<&MemLock> {
        self.lock.as_ref().filter(|l| l.expires > now)
    }

    /// The run-once state of the holder, made again (with its fence) if it went.
    fn holder_state(&mut self) -> &mut MemState {
        let writer = self.lock.as_ref().map_or(0, |l| l.fence);
        self.state.get_or_insert_with(|| MemState {
            writer,
            ..MemState::default()
        })
    }

    fn bytes(&self) -> usize {
        if self.slots() == 0 {
            return 0;
        }
        self.key.len() + self.state.as_ref().map_or(0, MemState::bytes)
    }

    fn slots(&self) -> usize {
        usize::from(self.lock.is_some()) + usize::from(self.state.is_some())
    }
}

/// The store: the entries, and what is counted and indexed about them.
#[derive(Debug)]
struct Store {
    entries: Entries,
    ix: Index,
}

/// Counts and indexes over the entries. Every index is exact (one entry per lock or state,
/// moved when it changes), so a sweep, and an eviction, costs O(log n) at any fill level.
/// Apart from the entries, so that an entry borrowed from them can be settled without a second
/// lookup. The indexes name entries by their slot in [`Entries`].
#[derive(Debug, Default)]
struct Index {
    /// Locks plus states (the entry bound counts both).
    slots: usize,
    /// Every lock, by expiry.
    locks: BTreeMap<At, usize>,
    /// Run-once state of names nobody holds, by expiry: what may be evicted, in eviction order.
    idle: BTreeMap<At, usize>,
    /// Run-once state under a held lock, by expiry: swept when it expires, never evicted.
    busy: BTreeMap<At, usize>,
    seq: u64,
    /// No index holds anything that expires before this (`None`: not known). A sweep before it
    /// has nothing to do and returns at once, instead of looking at three indexes on every
    /// operation; an insertion lowers it, a removal leaves it (still a lower bound).
    due: Option<Instant>,
    /// The last fencing token handed out, by any lock of the store.
    fence: u64,
    bytes: usize,
    /// Slots and bytes of the idle entries: what eviction could free at most.
    evictable: (usize, usize),
    evicted: u64,
    /// When eviction was last logged (one warning a minute, with the count).
    warned: Option<Instant>,
}

/// How often a store evicting state before its expiry says so.
const EVICTION_WARNING_EVERY: Duration = Duration::from_secs(60);

impl Index {
    /// The next fencing token (saturating: 2^64 acquisitions are not reached).
    fn next_fence(&mut self) -> u64 {
        self.fence = self.fence.saturating_add(1);
        self.fence
    }

    /// The earliest expiry any index holds.
    fn earliest(&self) -> Option<Instant> {
        [&self.locks, &self.idle, &self.busy]
            .into_iter()
            .filter_map(|index| index.first_key_value().map(|(at, _)| at.0))
            .min()
    }

    /// Whether `slots` more locks or states and `bytes` more bytes fit without evicting.
    fn fits(&self, limits: &MemoryLimits, slots: usize, bytes: usize) -> bool {
        self.slots + slots <= limits.max_entries && self.bytes + bytes <= limits.max_bytes
    }

    /// Settles a change to `entry` (in `slot`), which counted `before` (slots, bytes) until
    /// it: accounts for it and moves it in the indexes. Returns whether the entry is empty now
    /// (the caller removes it). Every change to an entry ends here.
    fn settle(&mut self, slot: usize, entry: &mut Entry, before: (usize, usize)) -> bool {
        let after = (entry.slots(), entry.bytes());
        self.slots = self.slots + after.0 - before.0;
        self.bytes = self.bytes + after.1 - before.1;
        // An entry is idle (evictable whole) when it holds a state and no lock.
        let evictable = if entry.lock.is_none() && entry.state.is_some() {
            after
        } else {
            (0, 0)
        };
        let counted = std::mem::replace(&mut entry.indexed.evictable, evictable);
        self.evictable.0 = self.evictable.0 + evictable.0 - counted.0;
        self.evictable.1 = self.evictable.1 + evictable.1 - counted.1;

        let want = entry.lock.as_ref().map(|l| l.expires);
        if entry.indexed.lock.map(|(at, _)| at) != want {
            if let Some(old) = entry.indexed.lock.take() {
                self.locks.remove(&old);
            }
            if let Some(at) = want {
                self.seq += 1;
                self.locks.insert((at, self.seq), slot);
                self.due = self.due.map(|due| due.min(at));
                entry.indexed.lock = Some((at, self.seq));
            }
        }
        let place = if entry.lock.is_some() {
            Place::Busy
        } else {
            Place::Idle
        };
        // A state without an expiry sorts last (it is still evictable).
        let want = entry
            .state
            .as_ref()
            .map(|s| (s.expires.unwrap_or_else(far), place));
        if entry.indexed.state.map(|((at, _), place)| (at, place)) != want {
            if let Some((old, place)) = entry.indexed.state.take() {
                match place {
                    Place::Idle => self.idle.remove(&old),
                    Place::Busy => self.busy.remove(&old),
                };
            }
            if let Some((at, place)) = want {
                self.seq += 1;
                let index = match place {
                    Place::Idle => &mut self.idle,
                    Place::Busy => &mut self.busy,
                };
                index.insert((at, self.seq), slot);
                self.due = self.due.map(|due| due.min(at));
                entry.indexed.state = Some(((at, self.seq), place));
            }
        }
        after.0 == 0
    }
}

impl Store {
    fn new(limits: &MemoryLimits) -> Self {
        Store {
            entries: Entries::with_bound(limits.max_entries),
            ix: Index::default(),
        }
    }

    /// Drops the lock (`lock`) or the state of the entry in `slot`, whose place in its index
    /// the caller already took out, and settles it.
    fn drop_indexed(&mut self, slot: usize, lock: bool) {
        let entry = self.entries.get_mut(slot);
        let before = (entry.slots(), entry.bytes());
        if lock {
            entry.indexed.lock = None;
            entry.lock = None;
        } else {
            entry.indexed.state = None;
            entry.state = None;
        }
        if self.ix.settle(slot, entry, before) {
            self.entries.remove(slot);
        }
    }

    /// Drops everything that expired by `now`.
    fn sweep(&mut self, now: Instant) {
        if self.ix.due.is_some_and(|due| now < due) {
            return;
        }
        loop {
            let first = |index: &BTreeMap<At, usize>| {
                index
                    .first_key_value()
                    .map(|(at, _)| *at)
                    .filter(|at| at.0 <= now)
            };
            let ix = &mut self.ix;
            let (lock, idle, busy) = (first(&ix.locks), first(&ix.idle), first(&ix.busy));
            let Some(at) = [lock, idle, busy].into_iter().flatten().min() else {
                // Nothing expired by `now`: the earliest expiry left is the next sweep's due.
                self.ix.due = Some(self.ix.earliest().unwrap_or_else(far));
                break;
            };
            let (index, is_lock) = if Some(at) == lock {
                (&mut ix.locks, true)
            } else if Some(at) == idle {
                (&mut ix.idle, false)
            } else {
                (&mut ix.busy, false)
            };
            let Some(slot) = index.remove(&at) else { break };
            self.drop_indexed(slot, is_lock);
        }
    }

    /// Makes room for `slots` more locks or states and `bytes` more bytes, evicting idle state
    /// in order of expiry, never the state of `keep` (the entry the room is for, if it has one,
    /// which counts `kept` as evictable). Returns false, having evicted nothing, if even
    /// evicting every other idle state would not make the room.
    fn make_room(
        &mut self,
        limits: &MemoryLimits,
        (slots, bytes): (usize, usize),
        keep: Option<usize>,
        kept: (usize, usize),
        now: Instant,
    ) -> bool {
        if self.ix.fits(limits, slots, bytes) {
            return true;
        }
        self.sweep(now);
        let free_slots = self.ix.evictable.0.saturating_sub(kept.0);
        let free_bytes = self.ix.evictable.1.saturating_sub(kept.1);
        if self.ix.slots.saturating_sub(free_slots) + slots > limits.max_entries
            || self.ix.bytes.saturating_sub(free_bytes) + bytes > limits.max_bytes
        {
            return false;
        }
        while !self.ix.fits(limits, slots, bytes) {
            let Some(at) = self
                .ix
                .idle
                .iter()
                .find(|(_, slot)| Some(**slot) != keep)
                .map(|(at, _)| *at)
            else {
                break;
            };
            let Some(slot) = self.ix.idle.remove(&at) else {
                break;
            };
            self.drop_indexed(slot, false);
            self.ix.evicted += 1;
            if self
                .ix
                .warned
                .is_none_or(|at| now.saturating_duration_since(at) >= EVICTION_WARNING_EVERY)
            {
                self.ix.warned = Some(now);
                tracing::warn!(
                    evicted = self.ix.evicted,
                    max_entries = limits.max_entries,
                    max_bytes = limits.max_bytes,
                    "in-memory lock store full: evicting idle state before its expiry \
                     (the oldest first; raise MemoryLimits if records must be kept longer)"
                );
            }
        }
        self.ix.fits(limits, slots, bytes)
    }
}

/// The sort key of a state that never expires: after every state that does.
fn far() -> Instant {
    static FAR: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *FAR.get_or_init(|| crate::clock::after(crate::clock::now(), Duration::MAX))
}

fn state_ttl(op: &Op) -> Option<Duration> {
    match &op.mode {
        Mode::Once { retention, .. } => Some(*retention),
        _ => op.state_ttl,
    }
}

fn capacity(op: &Op, store: &Store) -> LockError {
    LockError::Capacity {
        name: op.name.as_str().to_owned(),
        entries: store.ix.slots,
    }
}

/// The in-memory backend.
#[derive(Debug)]
pub(crate) struct MemoryBackend {
    store: Mutex<Store>,
    limits: MemoryLimits,
    waiters: Arc<Waiters>,
}

impl MemoryBackend {
    pub(crate) fn new(limits: MemoryLimits) -> Self {
        MemoryBackend {
            store: Mutex::new(Store::new(&limits)),
            limits,
            waiters: Waiters::local(),
        }
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn acquire_now(&self, op: &Op) -> Result<Attempt, LockError> {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let key = op.name.lock_key();
        let once = matches!(op.mode, Mode::Once { .. });
        let Store { entries, ix } = &mut *store;
        let found = entries.find(key);
        // What the entry counts for, what of it is evictable, and (if it has a state) what a
        // run-once acquisition frees of it: the tag it replaces and an abandoned writer's parts.
        let (before, kept, state) = match found {
            None => ((0, 0), (0, 0), None),
            Some(slot) => {
                let entry = entries.get_mut(slot);
                if once && let Some(record) = entry.state.as_ref().and_then(MemState::done) {
                    return Ok(Attempt::Done { record });
                }
                let before = (entry.slots(), entry.bytes());
                if let Some(lock) = entry.lock.as_mut().filter(|l| l.expires > now) {
                    let (ttl, fence) = (lock.expires - now, lock.fence);
                    if let (Holder::Reentrant { owner, holds }, Mode::Reentrant { owner: me }) =
                        (&mut lock.holder, &op.mode)
                        && owner == me
                    {
                        holds.insert(op.token);
                        lock.expires = lock.expires.max(now + op.lease);
                        ix.settle(slot, entry, before);
                        return Ok(Attempt::Acquired { fence });
                    }
                    let state = entry.state.as_ref();
                    return Ok(Attempt::Held {
                        ttl: Some(ttl),
                        tag: once.then(|| state.and_then(|s| s.tag.clone()).unwrap_or_default()),
                        fence: if once { fence } else { 0 },
                        parts: match state {
                            Some(s) if once => s.parts.len() as u64,
                            _ => 0,
                        },
                    });
                }
                let state = entry
                    .state
                    .as_ref()
                    .map(|s| s.tag.as_ref().map_or(0, Bytes::len) + s.parts_bytes);
                (before, entry.indexed.evictable, state)
            }
        };
        // Free (or expired but not swept yet).
        let fenced = op.fencing || !matches!(op.mode, Mode::Exclusive);
        let tag = match &op.mode {
            Mode::Once { tag, .. } => Some(tag.clone()),
            _ => None,
        };
        let new_slots = 1 + usize::from(once && state.is_none());
        let freed = if once { state.unwrap_or(0) } else { 0 };
        let new_bytes = (if before.0 == 0 { key.len() } else { 0 }
            + tag.as_ref().map_or(0, Bytes::len))
        .saturating_sub(freed);
        // Making room never evicts this entry (nor changes it: everything expired by `now` is
        // swept already), so `before` still holds.
        if !store.make_room(&self.limits, (new_slots, new_bytes), found, kept, now) {
            return Err(capacity(op, &store));
        }
        let Store { entries, ix } = &mut *store;
        let fence = if fenced { ix.next_fence() } else { 0 };
        let slot = found.unwrap_or_else(|| entries.insert(key));
        let entry = entries.get_mut(slot);
        if let Some(tag) = tag {
            // Run-once state: the tag while held, the record once completed. A new holder
            // starts from no parts (an abandoned writer's are dropped).
            let state = entry.state.get_or_insert_with(MemState::default);
            state.tag = Some(tag);
            state.since = Some(std::time::SystemTime::now());
            state.writer = fence;
            state.clear_parts();
            state.expires = state_ttl(op).map(|ttl| crate::clock::after(now, ttl));
        }
        let holder = match &op.mode {
            Mode::Reentrant { owner } => Holder::Reentrant {
                owner: owner.clone(),
                holds: HashSet::from([op.token]),
            },
            _ => Holder::Exclusive(op.token),
        };
        entry.lock = Some(MemLock {
            holder,
            fence,
            expires: now + op.lease,
        });
        ix.settle(slot, entry, before);
        Ok(Attempt::Acquired { fence })
    }

    fn owns(lock: &MemLock, op: &Op) -> bool {
        match (&lock.holder, &op.mode) {
            (Holder::Exclusive(token), Mode::Exclusive | Mode::Once { .. }) => *token == op.token,
            (Holder::Reentrant { owner, holds }, Mode::Reentrant { owner: me }) => {
                owner == me && holds.contains(&op.token)
            }
            _ => false,
        }
    }

    /// The slot of `op`'s entry if it holds a live lock of `op`'s.
    fn owned(entries: &Entries, op: &Op, now: Instant) -> Option<usize> {
        entries.find(op.name.lock_key()).filter(|&slot| {
            entries
                .get(slot)
                .live_lock(now)
                .is_some_and(|l| Self::owns(l, op))
        })
    }

    fn extend_now(&self, op: &Op, lease: Duration) -> bool {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let Store { entries, ix } = &mut *store;
        let Some(slot) = Self::owned(entries, op, now) else {
            return false;
        };
        let entry = entries.get_mut(slot);
        let ttl = state_ttl(op);
        let before = (entry.slots(), entry.bytes());
        let mut expires = now + lease;
        if let Some(lock) = entry.lock.as_mut() {
            if let Holder::Reentrant { .. } = lock.holder {
                // Shared by every hold of the owner: a renewal never cuts short the lease
                // another hold was promised (as `reentrant_extend.lua`).
                expires = expires.max(lock.expires);
            }
            lock.expires = expires;
        }
        if let (Some(state), Some(ttl)) = (entry.state.as_mut(), ttl) {
            state.expires = Some(crate::clock::after(now, ttl));
        }
        if ix.settle(slot, entry, before) {
            entries.remove(slot);
        }
        true
    }

    fn release_now(&self, op: &Op) -> bool {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let Store { entries, ix } = &mut *store;
        let Some(slot) = Self::owned(entries, op, now) else {
            return false;
        };
        let entry = entries.get_mut(slot);
        let before = (entry.slots(), entry.bytes());
        let last = match entry.lock.as_mut().map(|l| &mut l.holder) {
            Some(Holder::Reentrant { holds, .. }) => {
                holds.remove(&op.token);
                holds.is_empty()
            }
            _ => true,
        };
        if last {
            entry.lock = None;
            if let (Mode::Once { .. }, Some(state)) = (&op.mode, entry.state.as_mut()) {
                // No record: what was appended goes with the lock.
                state.clear_parts();
            }
            if ix.settle(slot, entry, before) {
                entries.remove(slot);
            }
            drop(store);
            self.waiters
                .wake(op.name.channel(), op.token.as_str().as_bytes());
        }
        true
    }

    fn complete_now(&self, op: &Op, record: &[u8], appended: u64) -> Result<bool, LockError> {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let Some(slot) = Self::owned(&store.entries, op, now) else {
            let mine = store
                .entries
                .find(op.name.lock_key())
                .and_then(|slot| store.entries.get(slot).state.as_ref())
                .and_then(|s| s.completed_by)
                .is_some_and(|t| t == op.token);
            return Ok(mine);
        };
        let entry = store.entries.get(slot);
        let before = (entry.slots(), entry.bytes());
        let replace = appended == super::REPLACE_PARTS;
        let stored = entry.state.as_ref().map_or(0, |s| s.parts.len() as u64);
        if stored != appended && !replace {
            return Err(LockError::broken(
                op.name.as_str(),
                format!("{appended} parts were appended, the store holds {stored}"),
            ));
        }
        // A whole record replaces the tag (and, replacing, the parts); a last part comes on top
        // of the others.
        let old = entry.state.as_ref().map_or(0, |s| {
            s.tag.as_ref().map_or(0, Bytes::len) + if replace { s.parts_bytes } else { 0 }
        });
        let kept = entry.indexed.evictable;
        let room = (0, record.len().saturating_sub(old));
        if !store.make_room(&self.limits, room, Some(slot), kept, now) {
            return Err(capacity(op, &store));
        }
        let ttl = state_ttl(op);
        let Store { entries, ix } = &mut *store;
        // Never evicted while held.
        let entry = entries.get_mut(slot);
        let state = entry.holder_state();
        if appended == 0 || replace {
            state.clear_parts();
            state.record = Some(Bytes::copy_from_slice(record));
        } else {
            state.push(record);
            state.streamed = Some(appended.saturating_add(1));
        }
        state.completed_by = Some(op.token);
        state.tag = None;
        state.expires = ttl.map(|ttl| crate::clock::after(now, ttl));
        entry.lock = None;
        if ix.settle(slot, entry, before) {
            entries.remove(slot);
        }
        drop(store);
        self.waiters
            .wake(op.name.channel(), op.token.as_str().as_bytes());
        Ok(true)
    }

    fn append_now(&self, op: &Op, index: u64, part: &[u8]) -> Result<Appended, LockError> {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let Some(slot) = Self::owned(&store.entries, op, now) else {
            return Ok(Appended::NotOwner);
        };
        let entry = store.entries.get(slot);
        let before = (entry.slots(), entry.bytes());
        let (len, same) = entry.state.as_ref().map_or((0, false), |s| {
            let same = usize::try_from(index)
                .ok()
                .and_then(|i| s.parts.get(i))
                .is_some_and(|p| p[..] == *part);
            (s.parts.len() as u64, same)
        });
        let push = if len == index {
            true
        } else if len == index.saturating_add(1) && same {
            false // a retry of this same append: already there
        } else {
            return Ok(Appended::Mismatch { len });
        };
        let kept = entry.indexed.evictable;
        // A state swept under its holder (a retention shorter than the hold) is made again.
        let room = (usize::from(entry.state.is_none()), part.len());
        if push && !store.make_room(&self.limits, room, Some(slot), kept, now) {
            return Err(capacity(op, &store));
        }
        let Store { entries, ix } = &mut *store;
        // Never evicted while held.
        let entry = entries.get_mut(slot);
        let state = entry.holder_state();
        if push {
            state.push(part);
        }
        // Every part lives as long as the record would.
        state.expires = state_ttl(op).map(|ttl| crate::clock::after(now, ttl));
        if ix.settle(slot, entry, before) {
            entries.remove(slot);
        }
        Ok(Appended::Stored)
    }

    fn inspect_now(&self, name: &LockName) -> Inspection {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let entry = store
            .entries
            .find(name.lock_key())
            .map(|slot| store.entries.get(slot));
        let lock = entry.and_then(|e| e.live_lock(now));
        let state = entry.and_then(|e| e.state.as_ref());
        Inspection {
            holder: lock.map(|lock| once::Holder {
                lease_left: Some(lock.expires - now),
                fence: lock.fence,
                tag: state.and_then(|s| s.tag.clone()).unwrap_or_default(),
                since: state.and_then(|s| s.since),
            }),
            record: state.and_then(MemState::done),
            fence: (lock.map(|l| l.fence).or(state.map(|s| s.writer))).filter(|f| *f > 0),
            expires_in: (state.and_then(|s| s.expires)).map(|at| at.saturating_duration_since(now)),
        }
    }

    fn purge_now(&self, name: &LockName) -> Purged {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let Store { entries, ix } = &mut *store;
        let Some(slot) = entries.find(name.lock_key()) else {
            return Purged::Absent;
        };
        let entry = entries.get_mut(slot);
        if let Some(lock) = entry.live_lock(now) {
            return Purged::InFlight {
                lease_left: Some(lock.expires - now),
            };
        }
        if entry.state.is_none() {
            return Purged::Absent;
        }
        let before = (entry.slots(), entry.bytes());
        entry.state = None;
        if ix.settle(slot, entry, before) {
            entries.remove(slot);
        }
        Purged::Deleted
    }

    fn scan_now(&self, prefix: &str, pattern: &str) -> Vec<String> {
        let store = self.store();
        let separator = if prefix.is_empty() { "" } else { ":" };
        let start = format!("{prefix}{separator}{{");
        let mut names: Vec<String> = store
            .entries
            .iter()
            .filter(|(_, entry)| entry.state.is_some())
            .filter_map(|(_, entry)| {
                let name = entry.key.strip_prefix(start.as_str())?.strip_suffix('}')?;
                glob(pattern.as_bytes(), name.as_bytes()).then(|| name.to_owned())
            })
            .collect();
        names.sort_unstable();
        names
    }

    fn parts_now(&self, name: &LockName, from: u64, max: usize) -> Result<Parts, LockError> {
        let now = crate::clock::now();
        let mut store = self.store();
        store.sweep(now);
        let entry = store
            .entries
            .find(name.lock_key())
            .map(|slot| store.entries.get(slot));
        let lock = entry.and_then(|e| e.live_lock(now));
        let Some(state) = entry.and_then(|e| e.state.as_ref()) else {
            let fence = lock.map_or(0, |l| l.fence);
            return Ok(match lock {
                // Held, by a holder whose state is gone: nothing written yet.
                Some(l) => Parts::new(
                    from,
                    Vec::new(),
                    fence,
                    RecordState::Writing { parts: 0 },
                    Some(l.expires - now),
                ),
                None => Parts::new(from, Vec::new(), fence, RecordState::Abandoned, None),
            });
        };
        let slice = |parts: &[Bytes]| -> Vec<Bytes> {
            let start = usize::try_from(from).unwrap_or(usize::MAX).min(parts.len());
            let end = start.saturating_add(max).min(parts.len());
            parts[start..end].to_vec()
        };
        if let Some(record) = &state.record {
            let parts = if from == 0 && max > 0 {
                vec![record.clone()]
            } else {
                Vec::new()
            };
            return Ok(Parts::new(
                from,
                parts,
                state.writer,
                RecordState::Done { parts: 1 },
                None,
            ));
        }
        if let Some(count) = state.streamed {
            return Ok(Parts::new(
                from,
                slice(&state.parts),
                state.writer,
                RecordState::Done { parts: count },
                None,
            ));
        }
        Ok(match lock {
            Some(l) => Parts::new(
                from,
                slice(&state.parts),
                l.fence,
                RecordState::Writing {
                    parts: state.parts.len() as u64,
                },
                Some(l.expires - now),
            ),
            None => Parts::new(from, Vec::new(), state.writer, RecordState::Abandoned, None),
        })
    }

    /// Entries and bytes in use, and how many were evicted early (for tests and metrics).
    #[cfg(test)]
    fn usage(&self) -> (usize, usize, u64) {
        let s = self.store();
        (s.ix.slots, s.ix.bytes, s.ix.evicted)
    }

    /// Entries in the expiry and eviction indexes (for tests).
    #[cfg(test)]
    fn indexed(&self) -> usize {
        let s = self.store();
        s.ix.locks.len() + s.ix.idle.len() + s.ix.busy.len()
    }

    /// The idle entries' slots and bytes as counted, and as recounted from scratch (for tests).
    #[cfg(test)]
    fn evictable(&self) -> ((usize, usize), (usize, usize)) {
        let s = self.store();
        let recounted = s
            .entries
            .iter()
            .map(|(_, e)| e)
            .filter(|e| e.lock.is_none() && e.state.is_some())
            .fold((0, 0), |(n, b), e| (n + e.slots(), b + e.bytes()));
        (s.ix.evictable, recounted)
    }

    /// Everything the store counts and indexes, recounted from the entries: what does not
    /// match (for tests).
    #[cfg(test)]
    fn audit(&self) -> Vec<String> {
        let s = self.store();
        let mut problems = Vec::new();
        let (mut slots, mut bytes, mut evictable) = (0, 0, (0, 0));
        let (mut locks, mut states) = (0, 0);
        for (slot, e) in s.entries.iter() {
            let key = &e.key;
            if e.slots() == 0 {
                problems.push(format!("{key}: an empty entry left in the map"));
            }
            slots += e.slots();
            bytes += e.bytes();
            if e.lock.is_none() && e.state.is_some() {
                evictable = (evictable.0 + e.slots(), evictable.1 + e.bytes());
            }
            match (&e.lock, e.indexed.lock) {
                (None, None) => {}
                (Some(lock), Some(at))
                    if at.0 == lock.expires && s.ix.locks.get(&at) == Some(&slot) =>
                {
                    locks += 1;
                }
                _ => problems.push(format!("{key}: its lock is not indexed at its expiry")),
            }
            let place = if e.lock.is_some() {
                Place::Busy
            } else {
                Place::Idle
            };
            match (&e.state, e.indexed.state) {
                (None, None) => {}
                (Some(state), Some((at, indexed)))
                    if at.0 == state.expires.unwrap_or_else(far)
                        && indexed == place
                        && match place {
                            Place::Idle => s.ix.idle.get(&at),
                            Place::Busy => s.ix.busy.get(&at),
                        } == Some(&slot) =>
                {
                    states += 1;
                }
                _ => problems.push(format!("{key}: its state is not indexed where it belongs")),
            }
        }
        problems.extend(s.entries.audit());
        if let (Some(due), Some(earliest)) = (s.ix.due, s.ix.earliest())
            && earliest < due
        {
            problems.push(format!(
                "the next sweep is due at {due:?}, after an expiry at {earliest:?}"
            ));
        }
        if (slots, bytes) != (s.ix.slots, s.ix.bytes) {
            problems.push(format!(
                "counted {:?} slots and bytes, recounted {:?}",
                (s.ix.slots, s.ix.bytes),
                (slots, bytes)
            ));
        }
        if evictable != s.ix.evictable {
            problems.push(format!(
                "counted {:?} evictable, recounted {evictable:?}",
                s.ix.evictable
            ));
        }
        if locks != s.ix.locks.len() || states != s.ix.idle.len() + s.ix.busy.len() {
            problems.push(format!(
                "stale index entries: {} locks and {} states indexed, {locks} and {states} in the map",
                s.ix.locks.len(),
                s.ix.idle.len() + s.ix.busy.len()
            ));
        }
        problems
    }
}

/// Whether `text` matches the glob `pattern`: `*` any run of bytes, `?` one byte, anything else
/// itself (what a `SCAN` pattern means without its character classes).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    // Where the last `*` was, and where in `text` it has matched up to.
    let (mut p, mut t, mut star) = (0, 0, None);
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|c| *c == b'*')
}

impl Backend for MemoryBackend {
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(std::future::ready(self.acquire_now(op)))
    }

    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(std::future::ready(Ok(self.extend_now(op, lease))))
    }

    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(std::future::ready(Ok(self.release_now(op))))
    }

    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
        appended: u64,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(std::future::ready(self.complete_now(op, record, appended)))
    }

    fn append<'a>(
        &'a self,
        op: &'a Op,
        index: u64,
        part: &'a [u8],
    ) -> BoxFuture<'a, Result<Appended, LockError>> {
        Box::pin(std::future::ready(self.append_now(op, index, part)))
    }

    fn parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Parts, LockError>> {
        Box::pin(std::future::ready(self.parts_now(name, from, max)))
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Inspection, LockError>> {
        Box::pin(std::future::ready(Ok(self.inspect_now(name))))
    }

    fn purge<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Purged, LockError>> {
        Box::pin(std::future::ready(Ok(self.purge_now(name))))
    }

    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, LockError>> {
        Box::pin(std::future::ready(Ok(self.scan_now(prefix, pattern))))
    }

    fn supports_streaming(&self) -> bool {
        true
    }

    fn memory_limits(&self) -> Option<MemoryLimits> {
        Some(self.limits)
    }

    fn prepare<'a>(
        &'a self,
        _probe: &'a LockName,
    ) -> BoxFuture<'a, Result<Vec<crate::StoreWarning>, LockError>> {
        Box::pin(std::future::ready(Ok(Vec::new())))
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    fn describe(&self) -> String {
        format!(
            "memory (max {} entries, {} bytes)",
            self.limits.max_entries, self.limits.max_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockName;

    #[test]
    fn globs_match_as_scan_patterns_do() {
        for (pattern, text, matches) in [
            ("*", "", true),
            ("*", "abc", true),
            ("a*", "abc", true),
            ("a*c", "abc", true),
            ("a*c", "abd", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("ab.*", "ab.1f", true),
            ("ab.*", "ab", false),
            ("*.x*y", "a.xzzy", true),
            ("*.x*y", "a.xzzyz", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
        ] {
            assert_eq!(
                glob(pattern.as_bytes(), text.as_bytes()),
                matches,
                "{pattern} {text}"
            );
        }
    }

    fn op(name: &str, mode: Mode, lease_ms: u64) -> Op {
        Op {
            name: LockName::new("t", name).unwrap(),
            token: Token::random(),
            lease: Duration::from_millis(lease_ms),
            drift: Duration::from_millis(2),
            fencing: true,
            state_ttl: None,
            mode,
        }
    }

    #[test]
    fn exclusive_lock_semantics_match_the_scripts() {
        let b = MemoryBackend::new(MemoryLimits::default());
        let a = op("k", Mode::Exclusive, 10_000);
        let c = Op {
            token: Token::random(),
            ..a.clone()
        };
        assert_eq!(b.acquire_now(&a).unwrap(), Attempt::Acquired { fence: 1 });
        assert!(matches!(
            b.acquire_now(&c).unwrap(),
            Attempt::Held {
                ttl: Some(_),
                tag: None,
                ..
            }
        ));
        assert!(!b.release_now(&c), "someone else's token releases nothing");
        assert!(!b.extend_now(&c, Duration::from_secs(1)));
        assert!(b.extend_now(&a, Duration::from_secs(1)));
        assert!(b.release_now(&a));
        assert!(!b.release_now(&a), "a second release finds nothing");
        assert_eq!(b.acquire_now(&c).unwrap(), Attempt::Acquired { fence: 2 });
    }

    #[test]
    fn expired_leases_free_the_lock_and_fences_keep_growing() {
        let b = MemoryBackend::new(MemoryLimits::default());
        let a = op("k", Mode::Exclusive, 20);
        assert_eq!(b.acquire_now(&a).unwrap(), Attempt::Acquired { fence: 1 });
        std::thread::sleep(Duration::from_millis(30));
        let c = Op {
            token: Token::random(),
            ..a.clone()
        };
        assert_eq!(b.acquire_now(&c).unwrap(), Attempt::Acquired { fence: 2 });
        assert!(
            !b.release_now(&a),
            "the old holder cannot delete the new lock"
        );
        assert!(!b.extend_now(&a, Duration::from_secs(1)));
    }

    #[test]
    fn reentrant_holds_nest_per_owner() {
        let b = MemoryBackend::new(MemoryLimits::default());
        let owner = OwnerId::random();
        let h1 = op(
            "r",
            Mode::Reentrant {
                owner: owner.clone(),
            },
            10_000,
        );
        let h2 = Op {
            token: Token::random(),
            ..h1.clone()
        };
        let other = op(
            "r",
            Mode::Reentrant {
                owner: OwnerId::random(),
            },
            10_000,
        );
        assert_eq!(b.acquire_now(&h1).unwrap(), Attempt::Acquired { fence: 1 });
        assert_eq!(b.acquire_now(&h2).unwrap(), Attempt::Acquired { fence: 1 });
        assert!(matches!(
            b.acquire_now(&other).unwrap(),
            Attempt::Held { .. }
        ));
        assert!(b.release_now(&h1));
        assert!(matches!(
            b.acquire_now(&other).unwrap(),
            Attempt::Held { .. }
        ));
        assert!(!b.release_now(&h1), "a hold is released once");
        assert!(b.release_now(&h2));
        assert_eq!(
            b.acquire_now(&other).unwrap(),
            Attempt::Acquired { fence: 2 }
        );
    }

    #[test]
    fn once_records_are_returned_and_tags_shown() {
        let b = MemoryBackend::new(MemoryLimits::default());
        let mode = Mode::Once {
            tag: Bytes::from_static(b"fp1"),
            retention: Duration::from_secs(60),
        };
        let a = op("o", mode.clone(), 10_000);
        let c = op("o", mode, 10_000);
        assert_eq!(b.acquire_now(&a).unwrap(), Attempt::Acquired { fence: 1 });
        match b.acquire_now(&c).unwrap() {
            Attempt::Held {
                ttl, tag, fence, ..
            } => {
                assert!(ttl.is_some());
                assert_eq!(tag, Some(Bytes::from_static(b"fp1")));
                assert_eq!(fence, 1, "the holder's fence");
            }
            other => panic!("{other:?}"),
        }
        assert!(!b.complete_now(&c, b"x", 0).unwrap());
        assert!(b.complete_now(&a, b"record", 0).unwrap());
        assert!(
            b.complete_now(&a, b"record", 0).unwrap(),
            "a retried completion is recognised"
        );
        assert!(!b.complete_now(&c, b"x", 0).unwrap());
        assert_eq!(
            b.acquire_now(&c).unwrap(),
            Attempt::Done {
                record: Record::new(Bytes::from_static(b"record"), 1)
            }
        );
    }

    #[test]
    fn memory_stays_bounded_by_evicting_idle_state_first() {
        let b = MemoryBackend::new(MemoryLimits::new(10, 1 << 20).unwrap());
        let mode = Mode::Once {
            tag: Bytes::new(),
            retention: Duration::from_secs(60),
        };
        for i in 0..50 {
            let o = op(&format!("k{i}"), mode.clone(), 10_000);
            assert!(matches!(
                b.acquire_now(&o).unwrap(),
                Attempt::Acquired { .. }
            ));
            assert!(b.complete_now(&o, b"r", 0).unwrap());
        }
        let (entries, _, evicted) = b.usage();
        assert!(entries <= 10, "{entries}");
        assert!(evicted >= 40);
        // Held locks are never evicted: with every slot held (records evicted to make room),
        // a new lock is refused.
        let held: Vec<_> = (0..10)
            .map(|i| {
                let o = op(&format!("h{i}"), Mode::Exclusive, 10_000);
                b.acquire_now(&o).unwrap();
                o
            })
            .collect();
        let more = op("h-extra", Mode::Exclusive, 10_000);
        assert!(matches!(
            b.acquire_now(&more),
            Err(LockError::Capacity { .. })
        ));
        for o in &held {
            assert!(b.release_now(o));
        }
    }

    /// Fencing on, acquire+release of ever-new names: no counter stays behind, so the store
    /// never fills (before: `Capacity` once every slot held a counter), and the fences of a
    /// name in use keep growing however much is evicted or expires around it.
    #[test]
    fn fencing_on_new_names_never_fills_the_store_and_fences_never_go_back() {
        let b = MemoryBackend::new(MemoryLimits::new(50, 1 << 20).unwrap());
        let mut last_hot = 0;
        for i in 0..2_000 {
            let o = op(&format!("name-{i}"), Mode::Exclusive, 10_000);
            assert!(matches!(
                b.acquire_now(&o).unwrap(),
                Attempt::Acquired { .. }
            ));
            assert!(b.release_now(&o));
            if i % 100 == 0 {
                let hot = op("hot", Mode::Exclusive, 10_000);
                let Attempt::Acquired { fence } = b.acquire_now(&hot).unwrap() else {
                    panic!("free")
                };
                assert!(fence > last_hot, "{fence} after {last_hot}");
                last_hot = fence;
                assert!(b.release_now(&hot));
            }
        }
        assert_eq!(b.usage().0, 0, "nothing kept for released names");
        // Full of held locks: refused, and the message says why.
        let held: Vec<_> = (0..50)
            .map(|i| {
                let o = op(&format!("held-{i}"), Mode::Exclusive, 10_000);
                b.acquire_now(&o).unwrap();
                o
            })
            .collect();
        let err = b
            .acquire_now(&op("one-more", Mode::Exclusive, 10_000))
            .unwrap_err();
        assert!(err.to_string().contains("held locks"), "{err}");
        drop(held);
    }

    /// Parts count against the byte budget as they are appended (a retried append once), are
    /// kept by a completed record, go back when an unfinished record is released, and an
    /// append beyond the budget is refused with nothing appended.
    #[test]
    fn byte_accounting_with_parts() {
        let b = MemoryBackend::new(MemoryLimits::new(100, 10_000).unwrap());
        let once = |name: &str| {
            op(
                name,
                Mode::Once {
                    tag: Bytes::from_static(b"tag"),
                    retention: Duration::from_secs(60),
                },
                10_000,
            )
        };
        let a = once("parts");
        assert!(matches!(
            b.acquire_now(&a).unwrap(),
            Attempt::Acquired { .. }
        ));
        let base = b.usage().1;
        assert_eq!(base, a.name.lock_key().len() + 3, "key and tag");
        assert_eq!(b.append_now(&a, 0, &[1; 1000]).unwrap(), Appended::Stored);
        assert_eq!(b.usage().1, base + 1000);
        assert_eq!(
            b.append_now(&a, 0, &[1; 1000]).unwrap(),
            Appended::Stored,
            "a retry of the same append"
        );
        assert_eq!(b.usage().1, base + 1000, "counted once");
        assert_eq!(
            b.append_now(&a, 0, &[2; 1000]).unwrap(),
            Appended::Mismatch { len: 1 },
            "another part at a taken index"
        );
        assert_eq!(
            b.append_now(&a, 5, b"x").unwrap(),
            Appended::Mismatch { len: 1 }
        );
        assert_eq!(b.append_now(&a, 1, &[3; 2000]).unwrap(), Appended::Stored);
        assert_eq!(b.usage().1, base + 3000);
        // Over the budget: refused, nothing appended, nothing counted.
        assert!(matches!(
            b.append_now(&a, 2, &[4; 8000]),
            Err(LockError::Capacity { .. })
        ));
        assert_eq!(b.usage().1, base + 3000);
        let stranger = Op {
            token: Token::random(),
            ..a.clone()
        };
        assert_eq!(
            b.append_now(&stranger, 2, b"x").unwrap(),
            Appended::NotOwner
        );
        // Completion: the last part comes on top, the tag goes.
        assert!(matches!(
            b.complete_now(&a, b"end", 1),
            Err(LockError::BrokenRecord { .. })
        ));
        assert!(b.complete_now(&a, b"end", 2).unwrap());
        let done = a.name.lock_key().len() + 3003;
        assert_eq!(b.usage(), (1, done, 0), "the record stays, the lock went");

        // An unfinished record released: its parts go, and the bytes with them.
        let c = once("released");
        b.acquire_now(&c).unwrap();
        b.append_now(&c, 0, &[5; 4000]).unwrap();
        assert_eq!(b.usage().1, done + c.name.lock_key().len() + 3 + 4000);
        assert!(b.release_now(&c));
        assert_eq!(b.usage().1, done + c.name.lock_key().len() + 3);
        // The next holder of an abandoned stream (lease ran out) starts from nothing.
        let d = Op {
            lease: Duration::from_millis(20),
            ..once("abandoned")
        };
        b.acquire_now(&d).unwrap();
        b.append_now(&d, 0, &[6; 500]).unwrap();
        let e = Op {
            token: Token::random(),
            ..d.clone()
        };
        std::thread::sleep(Duration::from_millis(30)); // the lease runs out
        assert_eq!(
            b.parts_now(&e.name, 0, 10).unwrap().state(),
            RecordState::Abandoned
        );
        assert!(matches!(
            b.acquire_now(&e).unwrap(),
            Attempt::Acquired { .. }
        ));
        let read = b.parts_now(&e.name, 0, 10).unwrap();
        assert_eq!(read.state(), RecordState::Writing { parts: 0 });
        assert_eq!(b.append_now(&d, 0, b"late").unwrap(), Appended::NotOwner);
        let (_, bytes, _) = b.usage();
        assert_eq!(
            bytes,
            done + c.name.lock_key().len() + 3 + e.name.lock_key().len() + 3,
            "the abandoned parts are not counted any more"
        );
    }

    /// A run-once name whose idle state is left over (an earlier holder aborted) is acquired
    /// again on a full store: making room must not evict that very state, counted as already
    /// there (before: it was, the store went one over its bound, and the completion of a
    /// request already running was refused with `Capacity`, so its work would run again).
    #[test]
    fn acquiring_on_a_full_store_never_evicts_its_own_state() {
        let once = |name: &str| {
            op(
                name,
                Mode::Once {
                    tag: Bytes::from_static(b"t"),
                    retention: Duration::from_secs(60),
                },
                10_000,
            )
        };
        for room in [3, 4] {
            let b = MemoryBackend::new(MemoryLimits::new(room, 1 << 20).unwrap());
            let a = once("a");
            assert!(matches!(
                b.acquire_now(&a).unwrap(),
                Attempt::Acquired { .. }
            ));
            assert!(b.release_now(&a), "aborted: its state stays, idle");
            if room == 4 {
                // A completed record, younger than a's state: the one to evict.
                let o = once("o");
                b.acquire_now(&o).unwrap();
                assert!(b.complete_now(&o, b"r", 0).unwrap());
            }
            let x = once("x");
            assert!(matches!(
                b.acquire_now(&x).unwrap(),
                Attempt::Acquired { .. }
            ));
            assert_eq!(b.usage().0, room, "full");
            let a2 = once("a");
            let taken = b.acquire_now(&a2);
            assert!(b.usage().0 <= room, "over the bound: {:?}", b.usage());
            if room == 3 {
                // Nothing else to evict: the lock has no room.
                assert!(
                    matches!(taken, Err(LockError::Capacity { .. })),
                    "{taken:?}"
                );
            } else {
                assert!(matches!(taken, Ok(Attempt::Acquired { .. })), "{taken:?}");
                assert_eq!(b.usage().2, 1, "o's record made the room");
                assert!(b.complete_now(&a2, b"r", 0).unwrap());
            }
            assert!(
                b.complete_now(&x, b"r", 0).unwrap(),
                "the running request's completion is stored"
            );
            assert!(b.usage().0 <= room, "{:?}", b.usage());
            let (counted, recounted) = b.evictable();
            assert_eq!(counted, recounted);
        }
    }

    /// A holder whose run-once state expired under it (a retention shorter than its hold) and
    /// was swept appends on a full store: the state it makes again takes a slot, so room is
    /// made for it like for any new state (before: the store went over its entry bound by one
    /// per such holder). A completion makes it again in place of the lock: no room needed.
    #[test]
    fn a_state_made_again_by_its_holder_counts_against_the_bound() {
        for complete in [true, false] {
            let b = MemoryBackend::new(MemoryLimits::new(4, 1 << 20).unwrap());
            let short = op(
                "short",
                Mode::Once {
                    tag: Bytes::from_static(b"t"),
                    retention: Duration::from_millis(20),
                },
                10_000,
            );
            assert!(matches!(
                b.acquire_now(&short).unwrap(),
                Attempt::Acquired { .. }
            ));
            std::thread::sleep(Duration::from_millis(30)); // the state expires, the lock is held
            // Fill the rest of the store with records.
            for i in 0..2 {
                let o = op(
                    &format!("k{i}"),
                    Mode::Once {
                        tag: Bytes::new(),
                        retention: Duration::from_secs(60),
                    },
                    10_000,
                );
                b.acquire_now(&o).unwrap();
                assert!(b.complete_now(&o, b"r", 0).unwrap());
            }
            let held = op("held", Mode::Exclusive, 10_000);
            b.acquire_now(&held).unwrap();
            assert_eq!(
                b.usage().0,
                4,
                "full: the held lock, two records, and one more lock"
            );
            if complete {
                assert!(b.complete_now(&short, b"record", 0).unwrap());
            } else {
                assert_eq!(b.append_now(&short, 0, b"part").unwrap(), Appended::Stored);
            }
            let (entries, _, evicted) = b.usage();
            assert!(
                entries <= 4,
                "over the bound: {entries} (complete: {complete})"
            );
            let needed = if complete { 0 } else { 1 };
            assert_eq!(evicted, needed, "records evicted (complete: {complete})");
            assert_eq!(b.audit(), Vec::<String>::new());
        }
    }

    /// A name whose abandoned writer left parts behind (its lease ran out) is acquired again on
    /// a store whose bytes they fill: the acquisition drops them, so it needs no room (before:
    /// it was counted as needing its tag's bytes on top, and refused with `Capacity`).
    #[test]
    fn acquiring_over_an_abandoned_stream_counts_what_it_drops() {
        let b = MemoryBackend::new(MemoryLimits::new(100, 10_000).unwrap());
        let mode = Mode::Once {
            tag: Bytes::from_static(b"tag"),
            retention: Duration::from_secs(60),
        };
        let a = op("a", mode.clone(), 20);
        assert!(matches!(
            b.acquire_now(&a).unwrap(),
            Attempt::Acquired { .. }
        ));
        b.append_now(&a, 0, &[1; 5_000]).unwrap();
        let fill = 10_000 - 1 - b.usage().1;
        b.append_now(&a, 1, &vec![2; fill]).unwrap();
        assert_eq!(b.usage().1, 9_999, "one byte short of the budget");
        std::thread::sleep(Duration::from_millis(30)); // the lease runs out
        let again = op("a", mode, 10_000);
        let taken = b.acquire_now(&again);
        assert!(matches!(taken, Ok(Attempt::Acquired { .. })), "{taken:?}");
        assert!(b.usage().1 <= 10_000, "{:?}", b.usage());
        let (counted, recounted) = b.evictable();
        assert_eq!(counted, recounted);
    }

    /// A part, record or tag that cannot fit even with every idle record evicted is refused
    /// without evicting any (before: every stored outcome went first, then it was refused
    /// anyway, so every one of their retries ran again).
    #[test]
    fn what_cannot_fit_evicts_nothing() {
        let b = MemoryBackend::new(MemoryLimits::new(100, 10_000).unwrap());
        let once = |name: &str, tag: &'static [u8]| {
            op(
                name,
                Mode::Once {
                    tag: Bytes::from_static(tag),
                    retention: Duration::from_secs(60),
                },
                10_000,
            )
        };
        for i in 0..5 {
            let o = once(&format!("k{i}"), b"t");
            b.acquire_now(&o).unwrap();
            assert!(b.complete_now(&o, &[1; 1000], 0).unwrap());
        }
        let kept = b.usage();
        let big = once("big", b"t");
        assert!(matches!(
            b.acquire_now(&big).unwrap(),
            Attempt::Acquired { .. }
        ));
        assert!(matches!(
            b.append_now(&big, 0, &[0; 20_000]),
            Err(LockError::Capacity { .. })
        ));
        assert!(matches!(
            b.complete_now(&big, &[0; 20_000], 0),
            Err(LockError::Capacity { .. })
        ));
        assert!(matches!(
            b.acquire_now(&once("huge-tag", &[0; 20_000])),
            Err(LockError::Capacity { .. })
        ));
        assert_eq!(
            b.usage().2,
            0,
            "nothing evicted: {:?} before, {:?}",
            kept,
            b.usage()
        );
        for i in 0..5 {
            let again = once(&format!("k{i}"), b"t");
            assert!(
                matches!(b.acquire_now(&again).unwrap(), Attempt::Done { .. }),
                "k{i}'s record is still there"
            );
        }
        // What fits once idle records go still gets its room.
        assert!(b.complete_now(&big, &[0; 7_000], 0).unwrap());
        assert!(b.usage().2 > 0, "evicted to make room");
        let (counted, recounted) = b.evictable();
        assert_eq!(counted, recounted);
    }

    #[test]
    fn byte_accounting_returns_to_zero() {
        let b = MemoryBackend::new(MemoryLimits::default());
        let mut o = op(
            "bytes",
            Mode::Once {
                tag: Bytes::from_static(b"tag"),
                retention: Duration::from_millis(30),
            },
            20,
        );
        assert!(matches!(
            b.acquire_now(&o).unwrap(),
            Attempt::Acquired { .. }
        ));
        assert!(b.complete_now(&o, &[7u8; 1000], 0).unwrap());
        assert!(b.usage().1 > 1000);
        std::thread::sleep(Duration::from_millis(40));
        o.token = Token::random();
        assert!(
            matches!(b.acquire_now(&o).unwrap(), Attempt::Acquired { fence: 2 }),
            "the state expired, the fence goes on"
        );
        assert!(b.release_now(&o));
        std::thread::sleep(Duration::from_millis(40));
        b.store().sweep(Instant::now());
        assert_eq!(b.usage(), (0, 0, 0));
        assert_eq!(b.store().entries.len(), 0, "nothing left in the map");
        assert_eq!(b.audit(), Vec::<String>::new());
    }

    /// Whatever the operations, on a few names in a small store with time passing (leases and
    /// retentions expiring, records evicted, streamed records appended, completed whole or
    /// broken off), every count and index matches a recount from the entries after every step,
    /// and no empty entry stays in the map.
    #[tokio::test(start_paused = true)]
    async fn every_count_and_index_matches_a_recount_after_every_operation() {
        for seed in 0..20 {
            let b = MemoryBackend::new(MemoryLimits::new(12, 4096).unwrap());
            let mut rng = fastrand::Rng::with_seed(seed);
            let owner = OwnerId::random();
            // What was acquired: the operation, and the parts it appended.
            let mut held: Vec<(Op, u64)> = Vec::new();
            for step in 0..400 {
                let pick = |rng: &mut fastrand::Rng, n: usize| rng.usize(0..n.max(1));
                match rng.u8(0..10) {
                    0..=3 => {
                        let mode = match rng.u8(0..3) {
                            0 => Mode::Exclusive,
                            1 => Mode::Reentrant {
                                owner: owner.clone(),
                            },
                            _ => Mode::Once {
                                tag: Bytes::from(vec![b't'; rng.usize(0..40)]),
                                retention: Duration::from_millis(rng.u64(500..1_500)),
                            },
                        };
                        let name = format!("n{}", rng.u8(0..6));
                        let o = op(&name, mode, [20, 100, 500][pick(&mut rng, 3)]);
                        if let Ok(Attempt::Acquired { .. }) = b.acquire_now(&o) {
                            held.push((o, 0));
                        }
                    }
                    4 if !held.is_empty() => {
                        let (o, _) = &held[pick(&mut rng, held.len())];
                        b.extend_now(o, Duration::from_millis(rng.u64(10..600)));
                    }
                    5 if !held.is_empty() => {
                        let (o, _) = held.swap_remove(pick(&mut rng, held.len()));
                        b.release_now(&o);
                    }
                    6 if !held.is_empty() => {
                        let i = pick(&mut rng, held.len());
                        let part = vec![b'p'; rng.usize(0..600)];
                        let (o, appended) = &mut held[i];
                        if let Ok(Appended::Stored) = b.append_now(o, *appended, &part) {
                            *appended += 1;
                        }
                    }
                    7 | 8 if !held.is_empty() => {
                        let (o, appended) = held.swap_remove(pick(&mut rng, held.len()));
                        let whole = rng.bool();
                        let record = vec![b'r'; rng.usize(0..900)];
                        let parts = if whole {
                            super::super::REPLACE_PARTS
                        } else {
                            appended
                        };
                        let _ = b.complete_now(&o, &record, parts);
                    }
                    _ => tokio::time::advance(Duration::from_millis(rng.u64(0..200))).await,
                }
                // (Every operation sweeps first: one that does nothing else.)
                b.parts_now(&LockName::new("t", "n0").unwrap(), 0, 1)
                    .unwrap();
                let problems = b.audit();
                assert!(
                    problems.is_empty(),
                    "seed {seed}, step {step}: {problems:?}"
                );
                // The sweep did its work, whatever it skipped on the way.
                let earliest = b.store().ix.earliest();
                assert!(
                    earliest.is_none_or(|at| at > crate::clock::now()),
                    "seed {seed}, step {step}: something expired outlived a sweep"
                );
                let (slots, bytes, _) = b.usage();
                assert!(
                    slots <= 12 && bytes <= 4096,
                    "seed {seed}, step {step}: over the bounds, {slots} slots, {bytes} bytes"
                );
            }
        }
    }

    /// The indexes hold one entry per lock and per state, whatever happens to them: renewals,
    /// reentrant holds, appends, completions, releases and evictions leave nothing stale behind
    /// (before: every renewal and every eviction left an entry that each later eviction walked
    /// past, so a full store cost O(n) per new key).
    #[test]
    fn indexes_hold_one_entry_per_lock_and_state() {
        let b = MemoryBackend::new(MemoryLimits::new(100, 1 << 20).unwrap());
        let check = |b: &MemoryBackend, at: &str| {
            let (slots, _, _) = b.usage();
            assert_eq!(
                b.indexed(),
                slots,
                "index entries vs locks and states, {at}"
            );
            let (counted, recounted) = b.evictable();
            assert_eq!(counted, recounted, "evictable slots and bytes, {at}");
        };
        let once = |name: &str| {
            op(
                name,
                Mode::Once {
                    tag: Bytes::from_static(b"tag"),
                    retention: Duration::from_secs(60),
                },
                10_000,
            )
        };
        // A held run-once lock renewed many times, with parts appended.
        let a = once("renewed");
        b.acquire_now(&a).unwrap();
        for i in 0..50 {
            assert!(b.extend_now(&a, Duration::from_secs(10)));
            assert_eq!(b.append_now(&a, i, b"part").unwrap(), Appended::Stored);
        }
        check(&b, "after renewals and appends");
        // Reentrant holds of one owner.
        let owner = OwnerId::random();
        let holds: Vec<_> = (0..20)
            .map(|_| {
                let h = op(
                    "reentrant",
                    Mode::Reentrant {
                        owner: owner.clone(),
                    },
                    10_000,
                );
                b.acquire_now(&h).unwrap();
                h
            })
            .collect();
        check(&b, "after reentrant holds");
        for h in &holds {
            assert!(b.release_now(h));
        }
        check(&b, "after reentrant releases");
        // Ten times more records than the store holds: every new one evicts an old one.
        for i in 0..1_000 {
            let o = once(&format!("k{i}"));
            assert!(matches!(
                b.acquire_now(&o).unwrap(),
                Attempt::Acquired { .. }
            ));
            assert!(b.complete_now(&o, b"record", 0).unwrap());
        }
        check(&b, "after evictions");
        assert!(b.usage().2 >= 900, "evicted {}", b.usage().2);
        // The renewed lock was never evicted: still ours, with its parts.
        assert!(b.complete_now(&a, b"end", 50).unwrap());
        check(&b, "after the held lock completed");
    }
}
