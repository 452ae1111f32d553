//! Exponential backoff with full jitter.

use std::time::Duration;

/// Exponential backoff with full jitter: the n-th delay is drawn uniformly from
/// `[0, min(max, base * 2^n)]`, so contenders that failed together do not retry together.
///
/// ```
/// use std::time::Duration;
/// let mut backoff = distlock::Backoff::new(Duration::from_millis(10), Duration::from_millis(80));
/// for _ in 0..20 {
///     assert!(backoff.next_delay() <= Duration::from_millis(80));
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    /// A backoff from `base` doubling up to `max`.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let b = distlock::Backoff::new(Duration::from_millis(1), Duration::from_secs(1));
    /// assert_eq!(b.attempts(), 0);
    /// ```
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max: max.max(base),
            attempt: 0,
            rng: fastrand::Rng::new(),
        }
    }

    /// The current upper bound of the delay, before jitter.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mut b = distlock::Backoff::new(Duration::from_millis(10), Duration::from_millis(25));
    /// assert_eq!(b.bound(), Duration::from_millis(10));
    /// b.next_delay();
    /// assert_eq!(b.bound(), Duration::from_millis(20));
    /// b.next_delay();
    /// assert_eq!(b.bound(), Duration::from_millis(25));
    /// ```
    pub fn bound(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(30)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Draws the next delay and grows the bound.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mut b = distlock::Backoff::new(Duration::from_millis(4), Duration::from_millis(4));
    /// assert!(b.next_delay() <= Duration::from_millis(4));
    /// ```
    pub fn next_delay(&mut self) -> Duration {
        let bound = self.bound();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(self.rng.u64(0..=nanos))
    }

    /// Delays drawn so far.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mut b = distlock::Backoff::new(Duration::from_millis(1), Duration::from_millis(2));
    /// b.next_delay();
    /// assert_eq!(b.attempts(), 1);
    /// ```
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Starts again from the base delay.
    ///
    /// ```
    /// # use std::time::Duration;
    /// let mut b = distlock::Backoff::new(Duration::from_millis(1), Duration::from_millis(8));
    /// b.next_delay();
    /// b.reset();
    /// assert_eq!(b.bound(), Duration::from_millis(1));
    /// ```
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_spread_over_the_whole_range() {
        let max = Duration::from_millis(100);
        let mut b = Backoff::new(Duration::from_millis(100), max);
        let delays: Vec<_> = (0..2000).map(|_| b.next_delay()).collect();
        assert!(delays.iter().all(|d| *d <= max));
        let low = delays.iter().filter(|d| **d < max / 4).count();
        let high = delays.iter().filter(|d| **d > max * 3 / 4).count();
        // Uniform: about a quarter in each end; a fixed delay would put all in one place.
        assert!(low > 300 && high > 300, "low {low} high {high}");
    }

    #[test]
    fn bound_saturates_instead_of_overflowing() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(3600));
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.bound(), Duration::from_secs(3600));
    }
}
