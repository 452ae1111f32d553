//! Lock timing configuration, validated when it is built.

use std::time::Duration;

/// A configuration that cannot work, with the reason.
///
/// Returned by [`LockConfigBuilder::build`] and by constructors that check their input (lock names,
/// key prefixes). The message names the field and says why the value was refused.
///
/// ```
/// use std::time::Duration;
/// use distlock::LockConfig;
///
/// let err = LockConfig::builder()
///     .lease(Duration::from_millis(100))
///     .renew_every(Duration::from_millis(80))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("renew_every"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field has a value that cannot work.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The configuration field (or argument) that was refused.
        field: &'static str,
        /// Why the value cannot work.
        reason: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

/// Timing of a lock: lease, renewal, clock drift allowance, per-command timeout, retry backoff and
/// an optional cap on the total hold time.
///
/// Build one with [`LockConfig::builder`]; every combination is checked when it is built, so a lock
/// never runs with a configuration that cannot keep its promises.
///
/// ```
/// use std::time::Duration;
/// use distlock::LockConfig;
///
/// let config = LockConfig::builder()
///     .lease(Duration::from_secs(10))
///     .max_hold(Duration::from_secs(60))
///     .build()?;
/// assert_eq!(config.renew_every(), Duration::from_secs(10) / 3);
/// assert_eq!(config.drift(), Duration::from_millis(102));
/// # Ok::<(), distlock::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockConfig {
    lease: Duration,
    renew_every: Duration,
    drift: Duration,
    op_timeout: Duration,
    retry_base: Duration,
    retry_max: Duration,
    max_hold: Option<Duration>,
    fence_ttl: Option<Duration>,
    watchdog: bool,
    fencing: bool,
    polling: bool,
    origin: LockConfigBuilder,
}

impl Default for LockConfig {
    fn default() -> Self {
        LockConfig::builder()
            .build()
            .expect("the default lock configuration is valid")
    }
}

impl LockConfig {
    /// Starts a builder with the defaults: a 10 s lease renewed every lease/3, a drift allowance of
    /// 1% of the lease + 2 ms, a 2 s per-command timeout (at most a third of
    /// `lease - drift - renew_every`, so that a renewal that times out can be retried in time), retry backoff from 10 ms
    /// to 500 ms with full jitter, no hold cap, fence counters kept forever, watchdog on.
    ///
    /// ```
    /// let config = distlock::LockConfig::builder().build().unwrap();
    /// assert_eq!(config.lease(), std::time::Duration::from_secs(10));
    /// ```
    pub fn builder() -> LockConfigBuilder {
        LockConfigBuilder::default()
    }

    /// How long one acquisition or renewal keeps the lock without further renewal.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.lease() > c.drift());
    /// ```
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Interval between watchdog renewals.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.renew_every() < c.lease() / 2);
    /// ```
    pub fn renew_every(&self) -> Duration {
        self.renew_every
    }

    /// Allowance for clock rate differences between this process and Redis: the lease counts as
    /// lost at `sent + lease - drift`, where `sent` is when the last successful acquire or renewal
    /// was sent.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert_eq!(c.drift(), c.lease() / 100 + std::time::Duration::from_millis(2));
    /// ```
    pub fn drift(&self) -> Duration {
        self.drift
    }

    /// Timeout for a single command sent to Redis.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.renew_every() + c.op_timeout() * 2 < c.lease() - c.drift());
    /// ```
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// First backoff delay while waiting for a lock.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.retry_base() <= c.retry_max());
    /// ```
    pub fn retry_base(&self) -> Duration {
        self.retry_base
    }

    /// Largest backoff delay while waiting for a lock (the polling fallback behind notifications).
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert_eq!(c.retry_max(), std::time::Duration::from_millis(500));
    /// ```
    pub fn retry_max(&self) -> Duration {
        self.retry_max
    }

    /// Cap on the total time a guard may hold the lock; `None` means renew while the guard lives.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert_eq!(c.max_hold(), None);
    /// ```
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// Expiry of the per-lock state key (the fencing counter); `None` keeps it forever.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert_eq!(c.fence_ttl(), None);
    /// ```
    pub fn fence_ttl(&self) -> Option<Duration> {
        self.fence_ttl
    }

    /// Whether acquisitions draw fencing tokens (default true).
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.fencing());
    /// ```
    pub fn fencing(&self) -> bool {
        self.fencing
    }

    /// Whether waiting polls the store as a fallback behind release notifications (default
    /// true).
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.polling());
    /// ```
    pub fn polling(&self) -> bool {
        self.polling
    }

    /// Whether a watchdog renews the lease while the guard lives.
    ///
    /// ```
    /// # let c = distlock::LockConfig::default();
    /// assert!(c.watchdog());
    /// ```
    pub fn watchdog(&self) -> bool {
        self.watchdog
    }

    /// The builder this configuration was built from: the values set explicitly stay, the ones
    /// left unset are derived again from the lease.
    ///
    /// ```
    /// use std::time::Duration;
    /// let base = distlock::LockConfig::default();
    /// let longer = base.to_builder().lease(Duration::from_secs(60)).build().unwrap();
    /// assert_eq!(longer.renew_every(), Duration::from_secs(20));
    /// ```
    pub fn to_builder(&self) -> LockConfigBuilder {
        self.origin.clone()
    }
}

/// Builder for [`LockConfig`]. Fields left unset are derived from the lease.
///
/// ```
/// use std::time::Duration;
/// let config = distlock::LockConfig::builder()
///     .lease(Duration::from_secs(5))
///     .renew_every(Duration::from_secs(1))
///     .retry(Duration::from_millis(5), Duration::from_millis(200))
///     .build()?;
/// assert_eq!(config.renew_every(), Duration::from_secs(1));
/// # Ok::<(), distlock::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct LockConfigBuilder {
    lease: Option<Duration>,
    renew_every: Option<Duration>,
    drift: Option<Duration>,
    op_timeout: Option<Duration>,
    retry_base: Option<Duration>,
    retry_max: Option<Duration>,
    max_hold: Option<Duration>,
    fence_ttl: Option<Duration>,
    watchdog: bool,
    fencing: bool,
    polling: bool,
}

impl Default for LockConfigBuilder {
    fn default() -> Self {
        LockConfigBuilder {
            lease: None,
            renew_every: None,
            drift: None,
            op_timeout: None,
            retry_base: None,
            retry_max: None,
            max_hold: None,
            fence_ttl: None,
            watchdog: true,
            fencing: true,
            polling: true,
        }
    }
}

/// Smallest lease accepted: Redis expiry has millisecond resolution and a lease must leave room for
/// a drift allowance and renewals.
const MIN_LEASE: Duration = Duration::from_millis(20);

/// Smallest drift allowance: Redis expiry has millisecond resolution.
const MIN_DRIFT: Duration = Duration::from_millis(1);

/// Longest lease, fence expiry or record retention accepted: about 100 years, far below what
/// Redis (milliseconds in an `i64`) and `Instant` can hold.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(100 * 365 * 86_400);

impl LockConfigBuilder {
    /// Sets the lease (default 10 s): a whole number of milliseconds, as Redis keeps it.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().lease(Duration::from_secs(3)).build().unwrap();
    /// assert_eq!(c.lease(), Duration::from_secs(3));
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Sets the watchdog renewal interval (default lease/3); it must be below lease/2 so that a
    /// failed renewal can be retried before the lease runs out.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().renew_every(Duration::from_secs(2)).build().unwrap();
    /// assert_eq!(c.renew_every(), Duration::from_secs(2));
    /// ```
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// Sets the clock drift allowance (default 1% of the lease + 2 ms); at least 1 ms, since
    /// Redis counts expiries in whole milliseconds.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().drift(Duration::from_millis(50)).build().unwrap();
    /// assert_eq!(c.drift(), Duration::from_millis(50));
    /// ```
    pub fn drift(mut self, drift: Duration) -> Self {
        self.drift = Some(drift);
        self
    }

    /// Sets the per-command timeout (default 2 s, at most a third of `lease - drift -
    /// renew_every`). It must be below half of that window: a renewal that times out is retried,
    /// and the retry must be confirmed before the lease ends.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().op_timeout(Duration::from_millis(250)).build().unwrap();
    /// assert_eq!(c.op_timeout(), Duration::from_millis(250));
    /// ```
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.op_timeout = Some(timeout);
        self
    }

    /// Sets the waiting backoff: delays grow exponentially from `base` up to `max`, each drawn
    /// uniformly from zero to the current bound (full jitter).
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder()
    ///     .retry(Duration::from_millis(1), Duration::from_millis(50))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(c.retry_max(), Duration::from_millis(50));
    /// ```
    pub fn retry(mut self, base: Duration, max: Duration) -> Self {
        self.retry_base = Some(base);
        self.retry_max = Some(max);
        self
    }

    /// Caps the total hold time: the watchdog never extends the lease past `acquired + max_hold`,
    /// and the loss signal fires when the cap is reached.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().max_hold(Duration::from_secs(60)).build().unwrap();
    /// assert_eq!(c.max_hold(), Some(Duration::from_secs(60)));
    /// ```
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// Lets the per-lock state (fencing counter) expire after `ttl` without activity, so locks on
    /// ever-new names do not accumulate keys. A counter made again after it expired starts from
    /// the caller's clock in microseconds, so a name's fences keep increasing across the expiry
    /// as long as the clocks of the machines that take it differ by less than `ttl`.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let c = distlock::LockConfig::builder().fence_ttl(Duration::from_secs(86_400)).build().unwrap();
    /// assert_eq!(c.fence_ttl(), Some(Duration::from_secs(86_400)));
    /// ```
    pub fn fence_ttl(mut self, ttl: Duration) -> Self {
        self.fence_ttl = Some(ttl);
        self
    }

    /// Turns lease renewal on or off (default on). Without it the lock is held for one lease and
    /// the loss signal fires at its end.
    ///
    /// ```
    /// let c = distlock::LockConfig::builder().watchdog(false).build().unwrap();
    /// assert!(!c.watchdog());
    /// ```
    pub fn watchdog(mut self, on: bool) -> Self {
        self.watchdog = on;
        self
    }

    /// Turns fencing tokens off for exclusive locks (default on). An acquisition is then the
    /// single command `SET key token NX PX lease` (followed by a `PTTL` only when the lock is
    /// held, so that a waiter knows when the lease ends) instead of a script that also increments the fencing
    /// counter: on a busy Redis, where Lua costs most, that roughly doubles how many locks one
    /// Redis can grant per second. [`LockGuard::fence`](crate::LockGuard::fence) is then
    /// always 0, and nothing protects a resource from a holder paused past its lease. Reentrant
    /// and run-once locks always fence.
    ///
    /// ```
    /// let c = distlock::LockConfig::builder().fencing(false).build().unwrap();
    /// assert!(!c.fencing());
    /// ```
    pub fn fencing(mut self, on: bool) -> Self {
        self.fencing = on;
        self
    }

    /// Turns the polling fallback of waiting off (default on). A waiter then wakes only when a
    /// release is announced (or when the holder's lease, as last seen, ends), never to look
    /// again on its own. Meant for tests that prove announcements arrive, and for stores where
    /// every release is announced and polling load matters; a lost announcement then costs a
    /// waiter the rest of the holder's lease.
    ///
    /// ```
    /// let c = distlock::LockConfig::builder().polling(false).build().unwrap();
    /// assert!(!c.polling());
    /// ```
    pub fn polling(mut self, on: bool) -> Self {
        self.polling = on;
        self
    }

    /// Checks every field against the others and returns the configuration, or the reason it
    /// cannot work.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let err = distlock::LockConfig::builder()
    ///     .lease(Duration::from_millis(100))
    ///     .drift(Duration::from_millis(100))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("drift"));
    /// ```
    pub fn build(self) -> Result<LockConfig, ConfigError> {
        let lease = self.lease.unwrap_or(Duration::from_secs(10));
        if lease < MIN_LEASE {
            return Err(ConfigError::invalid(
                "lease",
                format!("{lease:?} is below the minimum of {MIN_LEASE:?}"),
            ));
        }
        if lease > MAX_TTL {
            return Err(ConfigError::invalid(
                "lease",
                format!("{lease:?} is above the longest expiry accepted ({MAX_TTL:?})"),
            ));
        }
        if !lease.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::invalid(
                "lease",
                format!(
                    "{lease:?} is not a whole number of milliseconds: Redis keeps expiries in milliseconds, and a truncated lease would end before the holder believes"
                ),
            ));
        }
        let renew_every = self.renew_every.unwrap_or(lease / 3);
        if renew_every.is_zero() || renew_every >= lease / 2 {
            return Err(ConfigError::invalid(
                "renew_every",
                format!(
                    "{renew_every:?} must be above zero and below lease/2 ({:?}) so a failed renewal can be retried before the lease ends",
                    lease / 2
                ),
            ));
        }
        let drift = self.drift.unwrap_or(lease / 100 + Duration::from_millis(2));
        if drift < MIN_DRIFT {
            return Err(ConfigError::invalid(
                "drift",
                format!(
                    "{drift:?} is below {MIN_DRIFT:?}: Redis counts expiries in whole milliseconds from its own clock, so a key can expire up to 1 ms before sent + lease"
                ),
            ));
        }
        if drift >= lease - renew_every {
            return Err(ConfigError::invalid(
                "drift",
                format!(
                    "{drift:?} must be below lease - renew_every ({:?}); otherwise the lease counts as lost before the first renewal",
                    lease - renew_every
                ),
            ));
        }
        // A renewal sent at `renew_every` can take `op_timeout` to fail; its retry needs as much
        // again, and both must fit before the lease (minus drift) runs out.
        let renewal_window = lease - drift - renew_every;
        let op_timeout = self
            .op_timeout
            .unwrap_or_else(|| Duration::from_secs(2).min(renewal_window / 3));
        // (`checked_mul`: a timeout near `Duration::MAX` is refused, not an overflow.)
        if op_timeout.is_zero()
            || op_timeout
                .checked_mul(2)
                .is_none_or(|t| t >= renewal_window)
        {
            return Err(ConfigError::invalid(
                "op_timeout",
                format!(
                    "{op_timeout:?} must be above zero and below half of lease - drift - renew_every ({:?}): a renewal that times out must leave time for a retry before the lease ends",
                    renewal_window
                ),
            ));
        }
        let retry_base = self.retry_base.unwrap_or(Duration::from_millis(10));
        let retry_max = self.retry_max.unwrap_or(Duration::from_millis(500));
        if retry_base.is_zero() {
            return Err(ConfigError::invalid(
                "retry",
                "the base delay must be above zero (a zero delay is a busy-wait)",
            ));
        }
        if retry_max < retry_base {
            return Err(ConfigError::invalid(
                "retry",
                format!("max delay {retry_max:?} is below base delay {retry_base:?}"),
            ));
        }
        if let Some(cap) = self.max_hold
            && cap < lease
        {
            return Err(ConfigError::invalid(
                "max_hold",
                format!(
                    "{cap:?} is shorter than the lease {lease:?} the first acquisition already takes"
                ),
            ));
        }
        if let Some(ttl) = self.fence_ttl
            && ttl > MAX_TTL
        {
            return Err(ConfigError::invalid(
                "fence_ttl",
                format!(
                    "{ttl:?} is above the longest expiry accepted ({MAX_TTL:?}); leave it unset to keep counters forever"
                ),
            ));
        }
        if let Some(ttl) = self.fence_ttl
            && ttl < lease
        {
            return Err(ConfigError::invalid(
                "fence_ttl",
                format!(
                    "{ttl:?} is shorter than the lease {lease:?}: the fencing counter could expire while the lock is held"
                ),
            ));
        }
        Ok(LockConfig {
            origin: self.clone(),
            lease,
            renew_every,
            drift,
            op_timeout,
            retry_base,
            retry_max,
            max_hold: self.max_hold,
            fence_ttl: self.fence_ttl,
            watchdog: self.watchdog,
            fencing: self.fencing,
            polling: self.polling,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `op_timeout(Duration::MAX)` panicked in `build` (a multiplication that overflowed)
    /// instead of being refused as a configuration that cannot work.
    #[test]
    fn an_op_timeout_near_duration_max_is_refused_not_a_panic() {
        let refused = LockConfig::builder()
            .op_timeout(Duration::MAX)
            .build()
            .unwrap_err();
        assert!(refused.to_string().contains("op_timeout"), "{refused}");
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn defaults_are_derived_from_the_lease() {
        let c = LockConfig::builder().lease(ms(900)).build().unwrap();
        assert_eq!(c.renew_every(), ms(300));
        assert_eq!(c.drift(), ms(11));
        assert_eq!(c.op_timeout(), ms(589) / 3);
        // A renewal and one retry, each timing out, fit before the lease ends.
        assert!(c.renew_every() + c.op_timeout() * 2 < c.lease() - c.drift());
    }

    #[test]
    fn refuses_configurations_that_cannot_work() {
        let cases: Vec<(LockConfigBuilder, &str)> = vec![
            (LockConfig::builder().lease(ms(5)), "lease"),
            (
                LockConfig::builder().lease(ms(100)).renew_every(ms(50)),
                "renew_every",
            ),
            (
                LockConfig::builder().renew_every(Duration::ZERO),
                "renew_every",
            ),
            (LockConfig::builder().lease(ms(100)).drift(ms(70)), "drift"),
            (
                LockConfig::builder().lease(ms(100)).op_timeout(ms(99)),
                "op_timeout",
            ),
            (
                LockConfig::builder().op_timeout(Duration::ZERO),
                "op_timeout",
            ),
            (LockConfig::builder().retry(Duration::ZERO, ms(5)), "retry"),
            (LockConfig::builder().retry(ms(10), ms(5)), "retry"),
            (
                LockConfig::builder().lease(ms(1000)).max_hold(ms(999)),
                "max_hold",
            ),
            (
                LockConfig::builder().lease(ms(1000)).fence_ttl(ms(999)),
                "fence_ttl",
            ),
            (LockConfig::builder().fence_ttl(Duration::MAX), "fence_ttl"),
            (LockConfig::builder().lease(Duration::MAX), "lease"),
            // Redis truncates to milliseconds: the lease set would end before the one counted.
            (
                LockConfig::builder().lease(Duration::from_micros(100_500)),
                "lease",
            ),
            (LockConfig::builder().drift(Duration::ZERO), "drift"),
            (
                LockConfig::builder().drift(Duration::from_micros(500)),
                "drift",
            ),
            // A renewal at 333 ms that times out at 663 ms, and its retry timing out too,
            // would end after the lease (988 ms).
            (
                LockConfig::builder().lease(ms(1000)).op_timeout(ms(330)),
                "op_timeout",
            ),
        ];
        for (builder, field) in cases {
            match builder.clone().build() {
                Err(ConfigError::Invalid { field: f, reason }) => {
                    assert_eq!(f, field, "{builder:?}: {reason}");
                    assert!(!reason.is_empty());
                }
                other => panic!("{builder:?} was accepted: {other:?}"),
            }
        }
    }

    #[test]
    fn to_builder_rederives_timing_from_a_new_lease() {
        let c = LockConfig::default()
            .to_builder()
            .lease(ms(3000))
            .build()
            .unwrap();
        assert_eq!(c.renew_every(), ms(1000));
        assert_eq!(c.op_timeout(), (ms(3000) - ms(32) - ms(1000)) / 3);
    }

    #[test]
    fn huge_values_are_refused_or_saturate_never_panic() {
        let c = LockConfig::builder()
            .max_hold(Duration::MAX)
            .retry(ms(10), Duration::MAX)
            .build()
            .unwrap();
        assert_eq!(c.max_hold(), Some(Duration::MAX));
    }
}
