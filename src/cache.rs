//! The local replay cache: the records this instance completed, kept in its memory so that a
//! retry landing on it is replayed without a round trip to Redis.
//!
//! A stored record never changes: it only expires (the retention) or is purged. So an entry
//! lives until the record's retention ends (counted from before the completion was sent, so
//! never past the record), at most [`ReplayCache::max_age`], and until a purge is heard:
//! Redis announces every purge on the store's purge channel
//! ([`distlock::LockClient::purge_channel`]), which a task of the store listens to. The cache
//! serves only while that subscription is proven: the task publishes a heartbeat on the
//! channel every [`ReplayCache::heartbeat`] and must hear it back; when the connection breaks,
//! or a heartbeat does not come back within its period, the cache is emptied and serves
//! nothing until it is subscribed again, since purges announced meanwhile were missed. (A
//! heartbeat heard also proves every purge announced before it was heard.) A completion whose
//! answer arrives after a purge was heard (of any name) is not cached: the purge may have come
//! after it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use distlock::ConfigError;
use futures_util::StreamExt;

/// What an entry costs besides its record and two copies of its name (the map's and queue's
/// share, the allocation headers).
const ENTRY_OVERHEAD: usize = 96;

/// What starts a heartbeat's message: braces, which no store name holds.
const HEARTBEAT: &str = "{heartbeat}";

/// Bounds of a [`Store`](crate::Store)'s local replay cache
/// ([`Store::replay_cache`](crate::Store::replay_cache)).
///
/// | bound | default |
/// | --- | --- |
/// | entries | 10,000 |
/// | bytes (records, names and bookkeeping) | 16 MiB |
/// | age of an entry | 60 s (and never past the record's retention) |
/// | heartbeat | 5 s |
///
/// When full, the oldest entries go first.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ReplayCache;
/// let cache = ReplayCache::new(50_000, 64 << 20)?.max_age(Duration::from_secs(300))?;
/// assert_eq!(cache.entries(), 50_000);
/// assert!(ReplayCache::new(0, 1 << 20).is_err());
/// # Ok::<(), tower_idempotency::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCache {
    entries: usize,
    bytes: usize,
    max_age: Duration,
    heartbeat: Duration,
}

impl Default for ReplayCache {
    fn default() -> Self {
        ReplayCache {
            entries: 10_000,
            bytes: 16 << 20,
            max_age: Duration::from_secs(60),
            heartbeat: Duration::from_secs(5),
        }
    }
}

impl ReplayCache {
    /// At most `entries` records and `bytes` bytes.
    ///
    /// # Errors
    /// If either bound is zero.
    pub fn new(entries: usize, bytes: usize) -> Result<Self, ConfigError> {
        if entries == 0 || bytes == 0 {
            return Err(ConfigError::Invalid {
                field: "replay_cache",
                reason: format!("{entries} entries, {bytes} bytes: both bounds must be above zero"),
            });
        }
        Ok(ReplayCache {
            entries,
            bytes,
            ..ReplayCache::default()
        })
    }

    /// The longest an entry is kept (default 60 s): how long a record that Redis lost without
    /// a purge (evicted under a `volatile-*` or `allkeys-*` policy, flushed, deleted by hand,
    /// lost in a failover behind a proxy) can still be replayed here while another instance
    /// runs the request again.
    ///
    /// # Errors
    /// If `max_age` is zero.
    pub fn max_age(mut self, max_age: Duration) -> Result<Self, ConfigError> {
        if max_age.is_zero() {
            return Err(ConfigError::Invalid {
                field: "replay_cache",
                reason: "a zero max_age caches nothing".into(),
            });
        }
        self.max_age = max_age;
        Ok(self)
    }

    /// How often the purge subscription is proven (default 5 s): a heartbeat published on the
    /// purge channel must come back within this period, else the cache is emptied and serves
    /// nothing until subscribed again; and it serves only while the last heartbeat heard is
    /// less than two periods old (a listener stalled, a Redis paused). Every instance hears
    /// every other's heartbeats: with many instances, a longer period.
    ///
    /// # Errors
    /// If `heartbeat` is zero.
    ///
    /// ```
    /// let cache = tower_idempotency::ReplayCache::default()
    ///     .heartbeat(std::time::Duration::from_secs(2))?;
    /// # Ok::<(), tower_idempotency::ConfigError>(())
    /// ```
    pub fn heartbeat(mut self, heartbeat: Duration) -> Result<Self, ConfigError> {
        if heartbeat.is_zero() {
            return Err(ConfigError::Invalid {
                field: "replay_cache",
                reason: "a zero heartbeat".into(),
            });
        }
        self.heartbeat = heartbeat;
        Ok(self)
    }

    /// The entry bound.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// The byte bound.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What a replay cache has done since it was made ([`Store::replay_cache_stats`](crate::Store::replay_cache_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayCacheStats {
    /// Looks that found a record: replays without a round trip.
    pub hits: u64,
    /// Looks that found none (the store was asked).
    pub misses: u64,
    /// Records held now.
    pub entries: usize,
    /// Whether the cache serves now: subscribed to purges, its last heartbeat heard less than
    /// two periods ago.
    pub live: bool,
}

struct Entry {
    record: Bytes,
    expires: Instant,
    id: u64,
}

#[derive(Default)]
struct Entries {
    map: HashMap<Box<str>, Entry>,
    /// Names in insertion order, with the id of the entry inserted (an entry replaced or
    /// removed since leaves a stale id behind, skipped).
    order: VecDeque<(Box<str>, u64)>,
    bytes: usize,
    next_id: u64,
}

impl Entries {
    fn remove(&mut self, name: &str) {
        if let Some(entry) = self.map.remove(name) {
            self.bytes -= cost(name, &entry.record);
        }
    }

    fn evict_oldest(&mut self) {
        while let Some((name, id)) = self.order.pop_front() {
            if self.map.get(&name).is_some_and(|e| e.id == id) {
                self.remove(&name);
                return;
            }
        }
    }
}

fn cost(name: &str, record: &Bytes) -> usize {
    2 * name.len() + record.len() + ENTRY_OVERHEAD
}

/// A store's replay cache, shared by the layers on it.
pub(crate) struct Cache {
    limits: ReplayCache,
    entries: Mutex<Entries>,
    /// Bumped by every purge heard and every emptying: a completion sent before the bump is not
    /// cached.
    epoch: AtomicU64,
    live: AtomicBool,
    /// When the last heartbeat was heard (or the subscription confirmed), in milliseconds
    /// after `base`.
    heard: AtomicU64,
    base: Instant,
    hits: AtomicU64,
    misses: AtomicU64,
    /// Dropped with the cache: the listening task ends.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("limits", &self.limits)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Cache {
    /// A cache with `limits` whose purges are heard on `channel` of the Redis at `client`
    /// (a task of the current runtime).
    pub(crate) fn start(limits: ReplayCache, client: redis::Client, channel: String) -> Arc<Self> {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let cache = Arc::new(Cache::new(limits, stop));
        tokio::spawn(listen(client, channel, Arc::downgrade(&cache), stopped));
        cache
    }

    /// An empty cache, not serving until [`reset`](Self::reset) says so.
    fn new(limits: ReplayCache, stop: tokio::sync::oneshot::Sender<()>) -> Self {
        Cache {
            limits,
            entries: Mutex::default(),
            epoch: AtomicU64::new(0),
            live: AtomicBool::new(false),
            heard: AtomicU64::new(0),
            base: Instant::now(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            _stop: stop,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn millis_since_base(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The subscription is proven now (a heartbeat heard, the subscription confirmed).
    fn heard(&self) {
        self.heard
            .fetch_max(self.millis_since_base(), Ordering::AcqRel);
    }

    /// Whether the cache may serve: subscribed, and a heartbeat heard within two periods.
    fn serving(&self) -> bool {
        let window = 2 * u64::try_from(self.limits.heartbeat.as_millis()).unwrap_or(u64::MAX / 4);
        self.live.load(Ordering::Acquire)
            && self.millis_since_base() < self.heard.load(Ordering::Acquire).saturating_add(window)
    }

    /// The record completed here under `name`, if the cache holds it and may serve it.
    pub(crate) fn get(&self, name: &str) -> Option<Bytes> {
        let found = if self.serving() {
            let mut entries = self.lock();
            match entries.map.get(name) {
                Some(entry) if entry.expires > Instant::now() => Some(entry.record.clone()),
                Some(_) => {
                    entries.remove(name);
                    None
                }
                None => None,
            }
        } else {
            None
        };
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// The epoch to give [`insert`](Self::insert) for a completion about to be sent.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Keeps `record`, completed under `name` by a command sent at `sent` in `epoch`, for at
    /// most `retention` from then: unless a purge was heard (or the cache emptied) since.
    pub(crate) fn insert(
        &self,
        name: &str,
        record: &[u8],
        sent: Instant,
        retention: Duration,
        epoch: u64,
    ) {
        let record = Bytes::copy_from_slice(record);
        let size = cost(name, &record);
        if size > self.limits.bytes {
            return;
        }
        let mut entries = self.lock();
        // Under the lock: a purge heard bumps the epoch under it too.
        if !self.live.load(Ordering::Acquire) || self.epoch.load(Ordering::Acquire) != epoch {
            return;
        }
        entries.remove(name);
        while entries.map.len() >= self.limits.entries || entries.bytes + size > self.limits.bytes {
            entries.evict_oldest();
        }
        let id = entries.next_id;
        entries.next_id += 1;
        entries.bytes += size;
        entries.order.push_back((name.into(), id));
        entries.map.insert(
            name.into(),
            Entry {
                record,
                expires: sent + retention.min(self.limits.max_age),
                id,
            },
        );
        // The queue keeps stale ids of replaced entries: bounded by twice the entries.
        if entries.order.len() > self.limits.entries.saturating_mul(2) {
            let Entries { map, order, .. } = &mut *entries;
            order.retain(|(name, id)| map.get(name).is_some_and(|e| e.id == *id));
        }
    }

    /// Forgets `name` (purged, here or elsewhere).
    pub(crate) fn remove(&self, name: &str) {
        let mut entries = self.lock();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        entries.remove(name);
    }

    /// Empties the cache and says whether it may serve from now on.
    fn reset(&self, live: bool) {
        let mut entries = self.lock();
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.live.store(live, Ordering::Release);
        *entries = Entries::default();
    }

    pub(crate) fn stats(&self) -> ReplayCacheStats {
        ReplayCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.lock().map.len(),
            live: self.serving(),
        }
    }
}

/// Listens to the purge channel for `cache` until it is dropped: subscribes (again after any
/// failure, with backoff), empties the cache and lets it serve once subscribed, removes every
/// name announced, publishes a heartbeat every period and empties the cache and stops it
/// serving as soon as one is not heard back within its period.
async fn listen(
    client: redis::Client,
    channel: String,
    cache: Weak<Cache>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let Some(period) = cache.upgrade().map(|c| c.limits.heartbeat) else {
        return;
    };
    let mut backoff = distlock::Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let subscribed = tokio::select! {
            _ = &mut stopped => return,
            subscribed = tokio::time::timeout(period.max(Duration::from_secs(1)), async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(period));
                let publisher = client.get_multiplexed_async_connection_with_config(&config).await?;
                Ok::<_, redis::RedisError>((pubsub, publisher))
            }) => subscribed,
        };
        match subscribed {
            Ok(Ok((pubsub, publisher))) => {
                backoff.reset();
                let Some(live) = cache.upgrade() else { return };
                live.reset(true);
                live.heard();
                drop(live);
                // This task's own heartbeat (other instances publish theirs on the channel).
                let beat = format!("{HEARTBEAT}{}", distlock::Token::random());
                let mut messages = pubsub.into_on_message();
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                let mut awaited = false;
                loop {
                    tokio::select! {
                        _ = &mut stopped => return,
                        message = messages.next() => {
                            let Some(message) = message else { break };
                            let Some(live) = cache.upgrade() else { return };
                            match std::str::from_utf8(message.get_payload_bytes()) {
                                Ok(payload) if payload == beat => {
                                    awaited = false;
                                    live.heard();
                                }
                                // Another instance's heartbeat.
                                Ok(payload) if payload.starts_with(HEARTBEAT) => {}
                                Ok(name) => live.remove(name),
                                // Not a name: whatever it was, empty the cache.
                                Err(_) => live.reset(true),
                            }
                        }
                        _ = tick.tick() => {
                            if awaited {
                                break;
                            }
                            awaited = true;
                            // On a task of its own: purges are heard while it is on its way.
                            let mut publisher = publisher.clone();
                            let (channel, beat) = (channel.clone(), beat.clone());
                            tokio::spawn(async move {
                                let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
                                    .arg(channel)
                                    .arg(beat)
                                    .query_async(&mut publisher)
                                    .await;
                                if let Err(error) = sent {
                                    tracing::debug!(%error, "idempotency replay cache: heartbeat not sent");
                                }
                            });
                        }
                    }
                }
                tracing::debug!(
                    "idempotency replay cache: purge subscription lost or unproven; emptied until subscribed again"
                );
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "idempotency replay cache: cannot subscribe to purges; not serving");
            }
            Err(_) => {
                tracing::debug!(
                    "idempotency replay cache: subscribing to purges timed out; not serving"
                );
            }
        }
        let Some(live) = cache.upgrade() else { return };
        live.reset(false);
        drop(live);
        tokio::select! {
            _ = &mut stopped => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(entries: usize, bytes: usize) -> Arc<Cache> {
        let (stop, _) = tokio::sync::oneshot::channel();
        let limits = ReplayCache::new(entries, bytes)
            .unwrap()
            .heartbeat(DAY)
            .unwrap();
        let cache = Arc::new(Cache::new(limits, stop));
        cache.reset(true);
        cache.heard();
        cache
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_record_is_served_until_it_expires() {
        let c = cache(10, 1 << 20);
        let now = Instant::now();
        c.insert("a", b"ra", now, DAY, c.epoch());
        c.insert(
            "b",
            b"rb",
            now - Duration::from_secs(2),
            Duration::from_secs(1),
            c.epoch(),
        );
        assert_eq!(c.get("a").as_deref(), Some(&b"ra"[..]));
        assert_eq!(c.get("b"), None, "past its retention");
        let stats = c.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 1, 1));
    }

    #[test]
    fn never_past_max_age() {
        let mut c = cache(10, 1 << 20);
        Arc::get_mut(&mut c).unwrap().limits = ReplayCache::new(10, 1 << 20)
            .unwrap()
            .max_age(Duration::from_secs(1))
            .unwrap()
            .heartbeat(DAY)
            .unwrap();
        c.insert(
            "a",
            b"ra",
            Instant::now() - Duration::from_secs(2),
            DAY,
            c.epoch(),
        );
        assert_eq!(c.get("a"), None);
    }

    #[test]
    fn a_purge_heard_during_a_completion_keeps_it_out() {
        let c = cache(10, 1 << 20);
        let epoch = c.epoch();
        c.remove("other");
        c.insert("a", b"ra", Instant::now(), DAY, epoch);
        assert_eq!(c.get("a"), None);
        c.insert("a", b"ra", Instant::now(), DAY, c.epoch());
        c.remove("a");
        assert_eq!(c.get("a"), None, "removed");
    }

    #[test]
    fn nothing_served_or_kept_while_not_subscribed() {
        let c = cache(10, 1 << 20);
        c.insert("a", b"ra", Instant::now(), DAY, c.epoch());
        c.reset(false);
        assert_eq!(c.get("a"), None);
        c.insert("a", b"ra", Instant::now(), DAY, c.epoch());
        assert_eq!(c.stats().entries, 0);
        c.reset(true);
        assert_eq!(c.get("a"), None, "emptied, not restored");
    }

    #[test]
    fn nothing_served_once_the_last_heartbeat_is_two_periods_old() {
        let mut c = cache(10, 1 << 20);
        Arc::get_mut(&mut c).unwrap().limits = ReplayCache::default()
            .heartbeat(Duration::from_millis(10))
            .unwrap();
        c.heard();
        c.insert("a", b"ra", Instant::now(), DAY, c.epoch());
        assert!(c.get("a").is_some(), "heard just now");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(c.get("a"), None, "a listener that hears nothing");
        assert!(!c.stats().live);
        c.heard();
        assert!(c.get("a").is_some(), "heard again");
    }

    #[test]
    fn the_oldest_go_first_within_both_bounds() {
        let c = cache(3, 1 << 20);
        for name in ["a", "b", "c", "d"] {
            c.insert(name, b"r", Instant::now(), DAY, c.epoch());
        }
        assert_eq!(c.get("a"), None);
        assert!(c.get("d").is_some());
        let small = cache(100, 2 * (ENTRY_OVERHEAD + 12));
        for name in ["a", "b", "c"] {
            small.insert(name, b"0123456789", Instant::now(), DAY, small.epoch());
        }
        assert_eq!(small.stats().entries, 2);
        assert_eq!(small.get("a"), None);
        // Replaced entries do not grow the queue without bound.
        for _ in 0..100 {
            c.insert("d", b"r", Instant::now(), DAY, c.epoch());
        }
        assert!(c.lock().order.len() <= 6);
        // One record above the byte bound is not kept.
        small.insert("big", &[0; 1024], Instant::now(), DAY, small.epoch());
        assert_eq!(small.get("big"), None);
    }
}
