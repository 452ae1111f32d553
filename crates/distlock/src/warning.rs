//! What `prepare` finds about the store that the lock works with, but that weakens a promise.

/// Something about the store that the lock works with, but that weakens what it promises: what
/// [`LockClient::prepare`](crate::LockClient::prepare) logs as a warning (`tracing::warn!`), and
/// [`LockClient::prepare_with_warnings`](crate::LockClient::prepare_with_warnings) returns.
///
/// ```
/// let warning = distlock::StoreWarning::Eviction {
///     store: "redis (10.0.0.5:6379)".into(),
///     policy: "volatile-lru".into(),
///     maxmemory: 1 << 30,
/// };
/// assert!(warning.to_string().contains("maxmemory-policy volatile-lru"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreWarning {
    /// The server evicts keys before they expire when it reaches `maxmemory`: its
    /// `maxmemory-policy` is not `noeviction`. The `volatile-*` policies evict keys that have an
    /// expiry: a held lock (another client can then take it while its holder works on: two
    /// holders, which only fencing tokens can tell apart) or a stored run-once record (its
    /// work then runs again). The `allkeys-*` policies also evict fencing counters, whose
    /// fences then start again and repeat. Set `maxmemory-policy noeviction` on the lock's
    /// Redis (a full Redis then refuses new locks and records rather than dropping held ones).
    Eviction {
        /// The server, as the client describes it ([`LockClient::store`](crate::LockClient::store);
        /// a Redlock master by its address).
        store: String,
        /// The server's `maxmemory-policy`.
        policy: String,
        /// The server's `maxmemory` in bytes; 0 when none is set (nothing is evicted until one
        /// is, which `CONFIG SET` can do at any time).
        maxmemory: u64,
    },
}

impl std::fmt::Display for StoreWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreWarning::Eviction {
                store,
                policy,
                maxmemory,
            } => {
                let limit = if *maxmemory == 0 {
                    "no maxmemory set yet".to_owned()
                } else {
                    format!("maxmemory {maxmemory} bytes")
                };
                let counters = if policy.starts_with("allkeys") {
                    ", and fencing counters (fences then start again and repeat)"
                } else {
                    ""
                };
                write!(
                    f,
                    "{store}: maxmemory-policy {policy} ({limit}): at maxmemory Redis may evict \
                     a held lock (another client then takes it while its holder works on) or a \
                     stored run-once record (its work then runs again){counters}; set \
                     maxmemory-policy noeviction for locks"
                )
            }
        }
    }
}
