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
    /// 1% of the lease + 2 ms, a 2 s (at most lease/3) per-command timeout, retry backoff from 10 ms
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
    /// assert!(c.op_timeout() <= c.lease() / 3);
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
        }
    }
}

/// Smallest lease accepted: Redis expiry has millisecond resolution and a lease must leave room for
/// a drift allowance and renewals.
const MIN_LEASE: Duration = Duration::from_millis(20);

impl LockConfigBuilder {
    /// Sets the lease (default 10 s).
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

    /// Sets the clock drift allowance (default 1% of the lease + 2 ms).
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

    /// Sets the per-command timeout (default 2 s, at most lease/3).
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
    /// ever-new names do not accumulate keys. Fencing tokens stay strictly increasing as long as
    /// two holders of one name are less than `ttl` apart.
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
    /// single command `SET key token NX PX lease` (sent with `PTTL` in one round trip, so that a
    /// waiter knows when the lease ends) instead of a script that also increments the fencing
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
        if lease.as_millis() > i64::MAX as u128 / 2 {
            return Err(ConfigError::invalid("lease", "too large for Redis"));
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
        if drift >= lease - renew_every {
            return Err(ConfigError::invalid(
                "drift",
                format!(
                    "{drift:?} must be below lease - renew_every ({:?}); otherwise the lease counts as lost before the first renewal",
                    lease - renew_every
                ),
            ));
        }
        let op_timeout = self
            .op_timeout
            .unwrap_or_else(|| Duration::from_secs(2).min(lease / 3));
        if op_timeout.is_zero() || op_timeout >= lease - drift {
            return Err(ConfigError::invalid(
                "op_timeout",
                format!(
                    "{op_timeout:?} must be above zero and below lease - drift ({:?}); a slower reply leaves no valid lease",
                    lease - drift
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn defaults_are_derived_from_the_lease() {
        let c = LockConfig::builder().lease(ms(900)).build().unwrap();
        assert_eq!(c.renew_every(), ms(300));
        assert_eq!(c.drift(), ms(11));
        assert_eq!(c.op_timeout(), ms(300));
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
        assert_eq!(c.op_timeout(), ms(1000));
    }
}
