//! The in-memory store: the same operations and semantics as the Redis scripts, for a single
//! process and for unit tests. Expired entries are swept on every operation; memory is bounded by
//! an entry count and a byte budget.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::waiters::Waiters;
use super::{Attempt, Backend, BoxFuture, Mode, Op};
use crate::{ConfigError, LockError};

/// Bounds of the in-memory store.
///
/// When a new entry would exceed a bound, expired entries go first, then completed or idle state
/// (records, fencing counters with an expiry) in order of expiry; held locks are never evicted. If
/// nothing can be evicted the acquisition fails with [`LockError::Capacity`].
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
    /// At most `max_entries` locks and states together, and at most `max_bytes` of keys, tags and
    /// records. Both must be above zero.
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
    Exclusive(String),
    Reentrant {
        owner: String,
        holds: HashSet<String>,
    },
}

#[derive(Debug)]
struct MemLock {
    holder: Holder,
    fence: u64,
    expires: Instant,
}

#[derive(Debug, Default)]
struct MemState {
    fence: u64,
    tag: Option<Bytes>,
    record: Option<Bytes>,
    /// The token that stored the record (a retried completion is recognised).
    completed_by: Option<String>,
    expires: Option<Instant>,
}

impl MemState {
    fn bytes(&self) -> usize {
        self.tag.as_ref().map_or(0, Bytes::len) + self.record.as_ref().map_or(0, Bytes::len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Lock,
    State,
}

#[derive(Debug, Default)]
struct Store {
    locks: HashMap<String, MemLock>,
    states: HashMap<String, MemState>,
    /// Expiry index; entries whose expiry changed since are stale and skipped.
    expiries: BTreeMap<(Instant, u64), (Slot, String)>,
    seq: u64,
    bytes: usize,
    evicted: u64,
}

impl Store {
    fn index(&mut self, at: Instant, slot: Slot, key: &str) {
        self.seq += 1;
        self.expiries.insert((at, self.seq), (slot, key.to_owned()));
    }

    fn live_lock(&self, key: &str, now: Instant) -> Option<&MemLock> {
        self.locks.get(key).filter(|l| l.expires > now)
    }

    fn remove_state(&mut self, key: &str) {
        if let Some(s) = self.states.remove(key) {
            self.bytes -= s.bytes() + key.len();
        }
    }

    fn remove_lock(&mut self, key: &str) {
        if self.locks.remove(key).is_some() {
            self.bytes -= key.len();
        }
    }

    /// Drops everything that expired by `now`.
    fn sweep(&mut self, now: Instant) {
        while let Some(entry) = self.expiries.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (slot, key) = entry.remove();
            match slot {
                Slot::Lock => {
                    if self.locks.get(&key).is_some_and(|l| l.expires <= now) {
                        self.remove_lock(&key);
                    }
                }
                Slot::State => {
                    if self
                        .states
                        .get(&key)
                        .is_some_and(|s| s.expires.is_some_and(|e| e <= now))
                    {
                        self.remove_state(&key);
                    }
                }
            }
        }
    }

    /// Makes room for `entries` more entries and `bytes` more bytes, evicting idle state in order
    /// of expiry. Returns false if that is not possible.
    fn make_room(
        &mut self,
        limits: &MemoryLimits,
        entries: usize,
        bytes: usize,
        now: Instant,
    ) -> bool {
        let fits = |s: &Store| {
            s.locks.len() + s.states.len() + entries <= limits.max_entries
                && s.bytes + bytes <= limits.max_bytes
        };
        if fits(self) {
            return true;
        }
        self.sweep(now);
        let candidates: Vec<String> = self
            .expiries
            .values()
            .filter(|(slot, key)| *slot == Slot::State && !self.locks.contains_key(key))
            .map(|(_, key)| key.clone())
            .collect();
        for key in candidates {
            if fits(self) {
                break;
            }
            if self.states.contains_key(&key) {
                self.remove_state(&key);
                self.evicted += 1;
                tracing::warn!(
                    key,
                    "in-memory lock store full: evicted idle state before its expiry"
                );
            }
        }
        fits(self)
    }

    fn state_mut(&mut self, key: &str) -> &mut MemState {
        if !self.states.contains_key(key) {
            self.bytes += key.len();
            self.states.insert(key.to_owned(), MemState::default());
        }
        self.states.get_mut(key).expect("inserted above")
    }

    fn set_state_expiry(&mut self, key: &str, ttl: Option<Duration>, now: Instant) {
        if let Some(ttl) = ttl {
            let at = now + ttl;
            self.state_mut(key).expires = Some(at);
            self.index(at, Slot::State, key);
        }
    }

    fn set_lock_expiry(&mut self, key: &str, at: Instant) {
        if let Some(lock) = self.locks.get_mut(key) {
            lock.expires = at;
            self.index(at, Slot::Lock, key);
        }
    }
}

fn state_ttl(op: &Op) -> Option<Duration> {
    match &op.mode {
        Mode::Once { retention, .. } => Some(*retention),
        _ => op.state_ttl,
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
            store: Mutex::default(),
            limits,
            waiters: Waiters::local(),
        }
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn acquire_now(&self, op: &Op) -> Result<Attempt, LockError> {
        let now = Instant::now();
        let mut store = self.store();
        store.sweep(now);
        // Both maps are keyed by the lock key; the state of a lock sits beside it.
        let (lock_key, state_key) = (op.name.lock_key(), op.name.lock_key());
        if let Mode::Once { .. } = op.mode
            && let Some(record) = store.states.get(state_key).and_then(|s| s.record.clone())
        {
            return Ok(Attempt::Done { record });
        }
        if let Some(lock) = store.live_lock(lock_key, now) {
            let ttl = Some(lock.expires - now);
            let fence = lock.fence;
            match (&lock.holder, &op.mode) {
                (Holder::Reentrant { owner, .. }, Mode::Reentrant { owner: me })
                    if owner == me.as_str() =>
                {
                    let expires = lock.expires.max(now + op.lease);
                    if let Some(MemLock {
                        holder: Holder::Reentrant { holds, .. },
                        ..
                    }) = store.locks.get_mut(lock_key)
                    {
                        holds.insert(op.token.as_str().to_owned());
                    }
                    store.set_lock_expiry(lock_key, expires);
                    return Ok(Attempt::Acquired { fence });
                }
                _ => {
                    let tag = match op.mode {
                        Mode::Once { .. } => Some(
                            store
                                .states
                                .get(state_key)
                                .and_then(|s| s.tag.clone())
                                .unwrap_or_default(),
                        ),
                        _ => None,
                    };
                    return Ok(Attempt::Held { ttl, tag });
                }
            }
        }
        // Free (or expired but not yet swept).
        store.remove_lock(lock_key);
        let tag = match &op.mode {
            Mode::Once { tag, .. } => Some(tag.clone()),
            _ => None,
        };
        if matches!(op.mode, Mode::Exclusive) && !op.fencing {
            if !store.make_room(&self.limits, 1, lock_key.len(), now) {
                return Err(LockError::Capacity {
                    name: op.name.as_str().to_owned(),
                    entries: store.locks.len() + store.states.len(),
                });
            }
            store.bytes += lock_key.len();
            let holder = Holder::Exclusive(op.token.as_str().to_owned());
            store.locks.insert(
                lock_key.to_owned(),
                MemLock {
                    holder,
                    fence: 0,
                    expires: now + op.lease,
                },
            );
            store.index(now + op.lease, Slot::Lock, lock_key);
            return Ok(Attempt::Acquired { fence: 0 });
        }
        let new_state = !store.states.contains_key(state_key);
        let bytes = lock_key.len()
            + tag.as_ref().map_or(0, Bytes::len)
            + if new_state { state_key.len() } else { 0 };
        if !store.make_room(&self.limits, 1 + usize::from(new_state), bytes, now) {
            return Err(LockError::Capacity {
                name: op.name.as_str().to_owned(),
                entries: store.locks.len() + store.states.len(),
            });
        }
        let state = store.state_mut(state_key);
        state.fence += 1;
        let fence = state.fence;
        if let Some(tag) = tag {
            let old = state.tag.replace(tag.clone()).map_or(0, |t| t.len());
            store.bytes = store.bytes + tag.len() - old;
        }
        store.set_state_expiry(state_key, state_ttl(op), now);
        let holder = match &op.mode {
            Mode::Reentrant { owner } => Holder::Reentrant {
                owner: owner.as_str().to_owned(),
                holds: HashSet::from([op.token.as_str().to_owned()]),
            },
            _ => Holder::Exclusive(op.token.as_str().to_owned()),
        };
        store.bytes += lock_key.len();
        store.locks.insert(
            lock_key.to_owned(),
            MemLock {
                holder,
                fence,
                expires: now + op.lease,
            },
        );
        store.index(now + op.lease, Slot::Lock, lock_key);
        Ok(Attempt::Acquired { fence })
    }

    fn owns(lock: &MemLock, op: &Op) -> bool {
        match (&lock.holder, &op.mode) {
            (Holder::Exclusive(token), Mode::Exclusive | Mode::Once { .. }) => {
                token == op.token.as_str()
            }
            (Holder::Reentrant { owner, holds }, Mode::Reentrant { owner: me }) => {
                owner == me.as_str() && holds.contains(op.token.as_str())
            }
            _ => false,
        }
    }

    fn extend_now(&self, op: &Op, lease: Duration) -> bool {
        let now = Instant::now();
        let mut store = self.store();
        store.sweep(now);
        let key = op.name.lock_key();
        if !store.live_lock(key, now).is_some_and(|l| Self::owns(l, op)) {
            return false;
        }
        store.set_lock_expiry(key, now + lease);
        store.set_state_expiry(key, state_ttl(op), now);
        true
    }

    fn release_now(&self, op: &Op) -> bool {
        let now = Instant::now();
        let mut store = self.store();
        store.sweep(now);
        let key = op.name.lock_key();
        if !store.live_lock(key, now).is_some_and(|l| Self::owns(l, op)) {
            return false;
        }
        let last = match store.locks.get_mut(key).map(|l| &mut l.holder) {
            Some(Holder::Reentrant { holds, .. }) => {
                holds.remove(op.token.as_str());
                holds.is_empty()
            }
            _ => true,
        };
        if last {
            store.remove_lock(key);
            drop(store);
            self.waiters
                .wake(op.name.channel(), op.token.as_str().as_bytes());
        }
        true
    }

    fn complete_now(&self, op: &Op, record: &[u8]) -> Result<bool, LockError> {
        let now = Instant::now();
        let mut store = self.store();
        store.sweep(now);
        let key = op.name.lock_key();
        if !store.live_lock(key, now).is_some_and(|l| Self::owns(l, op)) {
            let mine = store
                .states
                .get(key)
                .and_then(|s| s.completed_by.as_deref())
                .is_some_and(|t| t == op.token.as_str());
            return Ok(mine);
        }
        let state_key = key;
        let old = store.states.get(state_key).map_or(0, MemState::bytes);
        let grow = record.len().saturating_sub(old);
        if !store.make_room(&self.limits, 0, grow, now) {
            return Err(LockError::Capacity {
                name: op.name.as_str().to_owned(),
                entries: store.locks.len() + store.states.len(),
            });
        }
        let state = store.state_mut(state_key);
        state.record = Some(Bytes::copy_from_slice(record));
        state.completed_by = Some(op.token.as_str().to_owned());
        state.tag = None;
        let new = state.bytes();
        store.bytes = store.bytes + new - old;
        store.set_state_expiry(state_key, state_ttl(op), now);
        store.remove_lock(key);
        drop(store);
        self.waiters
            .wake(op.name.channel(), op.token.as_str().as_bytes());
        Ok(true)
    }

    /// Entries and bytes in use, and how many were evicted early (for tests and metrics).
    #[cfg(test)]
    fn usage(&self) -> (usize, usize, u64) {
        let s = self.store();
        (s.locks.len() + s.states.len(), s.bytes, s.evicted)
    }
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
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(std::future::ready(self.complete_now(op, record)))
    }

    fn prepare(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(std::future::ready(Ok(())))
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
    use crate::{LockName, OwnerId, Token};

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
                tag: None
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
            Attempt::Held { ttl, tag } => {
                assert!(ttl.is_some());
                assert_eq!(tag, Some(Bytes::from_static(b"fp1")));
            }
            other => panic!("{other:?}"),
        }
        assert!(!b.complete_now(&c, b"x").unwrap());
        assert!(b.complete_now(&a, b"record").unwrap());
        assert!(
            b.complete_now(&a, b"record").unwrap(),
            "a retried completion is recognised"
        );
        assert!(!b.complete_now(&c, b"x").unwrap());
        assert_eq!(
            b.acquire_now(&c).unwrap(),
            Attempt::Done {
                record: Bytes::from_static(b"record")
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
            assert!(b.complete_now(&o, b"r").unwrap());
        }
        let (entries, _, evicted) = b.usage();
        assert!(entries <= 10, "{entries}");
        assert!(evicted >= 40);
        // Held locks are never evicted: with every slot held, a new lock is refused.
        let held: Vec<_> = (0..5)
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
        assert!(b.complete_now(&o, &[7u8; 1000]).unwrap());
        assert!(b.usage().1 > 1000);
        std::thread::sleep(Duration::from_millis(40));
        o.token = Token::random();
        assert!(matches!(
            b.acquire_now(&o).unwrap(),
            Attempt::Acquired { fence: 1 }
        ));
        assert!(b.release_now(&o));
        std::thread::sleep(Duration::from_millis(40));
        b.store().sweep(Instant::now());
        assert_eq!(b.usage(), (0, 0, 0));
    }
}
