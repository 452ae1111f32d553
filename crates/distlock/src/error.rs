//! Errors and the reasons a lease can be lost.

use std::time::Duration;

/// Why a lock operation did not succeed.
///
/// The variants keep apart what callers must treat differently: another owner holds the lock
/// ([`LockError::Held`]), the wait deadline passed ([`LockError::WaitTimeout`]), the store could not
/// be reached or did not answer in time ([`LockError::Unavailable`]), and a lease that was held and
/// is now lost ([`LockError::LeaseLost`]).
///
/// ```
/// use distlock::LockError;
///
/// fn retry_later(err: &LockError) -> bool {
///     matches!(err, LockError::Held { .. } | LockError::WaitTimeout { .. })
/// }
/// # let _ = retry_later;
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another owner holds the lock (one attempt, no waiting).
    #[error("lock {name:?} is held by another owner{}", fmt_retry(*retry_after))]
    Held {
        /// The lock name.
        name: String,
        /// Remaining lease of the current holder, when the store reported it.
        retry_after: Option<Duration>,
    },
    /// The wait deadline passed before the lock became free.
    #[error("gave up waiting for lock {name:?} after {waited:?}")]
    WaitTimeout {
        /// The lock name.
        name: String,
        /// How long the call waited.
        waited: Duration,
    },
    /// The store could not be reached or did not answer in time. When `ambiguous` is true the
    /// failed command may still have taken the lock; a cleanup with the attempt's owner token was
    /// sent, and the lease bounds how long such a lock can live.
    #[error("redis unavailable for lock {name:?}{}", if *ambiguous { " (the attempt may have taken the lock; cleanup sent)" } else { "" })]
    Unavailable {
        /// The lock name.
        name: String,
        /// Whether the failed command may have acquired the lock.
        ambiguous: bool,
        /// The Redis error (I/O, timeout, connection refused, cluster down, ...).
        #[source]
        source: redis::RedisError,
    },
    /// Redis answered with an error that retrying will not fix (for example the key holds a value
    /// of another type, or a script failed).
    #[error("redis refused the command for lock {name:?}")]
    Redis {
        /// The lock name.
        name: String,
        /// The error Redis returned.
        #[source]
        source: redis::RedisError,
    },
    /// Fewer nodes than a quorum confirmed the operation (Redlock).
    #[error(
        "lock {name:?}: {confirmed} of {nodes} nodes confirmed, a quorum of {quorum} is needed"
    )]
    NoQuorum {
        /// The lock name.
        name: String,
        /// Nodes that confirmed in time.
        confirmed: usize,
        /// Nodes in the group.
        nodes: usize,
        /// Nodes that must confirm.
        quorum: usize,
        /// The last error a node returned, if any.
        #[source]
        source: Option<redis::RedisError>,
    },
    /// The lock was taken on the master, but fewer replicas than required acknowledged it within
    /// the timeout (see [`LockClientBuilder::replicas`](crate::LockClientBuilder::replicas)); it
    /// was released again.
    #[error(
        "lock {name:?}: {acknowledged} of {wanted} replicas acknowledged the acquisition in time; released"
    )]
    NotReplicated {
        /// The lock name.
        name: String,
        /// Replicas that acknowledged.
        acknowledged: usize,
        /// Replicas required.
        wanted: usize,
    },
    /// The in-memory store is at its configured capacity and nothing in it can be evicted:
    /// every entry is a held lock (or a record is larger than the whole byte budget). Records
    /// kept for their retention and expired entries are evicted before this happens.
    #[error(
        "in-memory lock store is full ({entries} entries, none evictable: held locks); lock {name:?} was not taken"
    )]
    Capacity {
        /// The lock name.
        name: String,
        /// Entries in the store.
        entries: usize,
    },
    /// The lease was lost: it could not be renewed in time, another owner took the lock, or the
    /// hold cap was reached.
    #[error("lease on lock {name:?} lost: {reason}")]
    LeaseLost {
        /// The lock name.
        name: String,
        /// Why the lease is lost.
        reason: LossReason,
    },
    /// The store does not offer this operation: streamed run-once records on Redlock (see
    /// [`LockClient::supports_streaming`](crate::LockClient::supports_streaming)). Nothing was
    /// sent; write the record whole with [`OnceGuard::complete`](crate::OnceGuard::complete).
    #[error("lock {name:?}: {operation} is not supported by the {store} store")]
    Unsupported {
        /// The lock name.
        name: String,
        /// The operation refused (`"append"`, `"parts"`).
        operation: &'static str,
        /// The store, as [`LockClient::store`](crate::LockClient::store) describes it.
        store: String,
    },
    /// A part (or a whole record) is larger than the store accepts
    /// ([`once::MAX_PART_LEN`](crate::once::MAX_PART_LEN) on every store; on Redlock, what
    /// a master can be sent within the timeouts:
    /// [`LockClient::max_record_len`](crate::LockClient::max_record_len)). Nothing was sent.
    #[error("lock {name:?}: a part of {len} bytes is over the limit of {max} bytes")]
    TooLarge {
        /// The lock name.
        name: String,
        /// The size of the part.
        len: usize,
        /// The largest size accepted.
        max: usize,
    },
    /// The parts of a streamed run-once record in the store are not what its writer appended:
    /// a part is missing (evicted or deleted behind the record's back) or differs from a retried
    /// append. The record must not be presented as complete; the writer's
    /// [`OnceGuard`](crate::OnceGuard) should be dropped (its parts are then deleted).
    #[error("the record of lock {name:?} is broken: {detail}")]
    BrokenRecord {
        /// The lock name.
        name: String,
        /// What does not match.
        detail: String,
    },
    /// A name, prefix or configuration was refused (see [`ConfigError`](crate::ConfigError)).
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
    /// The SQL database of the Postgres store failed: it could not be reached
    /// (`unreachable`; when `ambiguous`, the failed statement may have taken the lock or stored
    /// the record), or it refused the statement.
    #[error("the database failed for lock {name:?}{}", if *ambiguous { " (the statement may have taken effect)" } else { "" })]
    Database {
        /// The lock name.
        name: String,
        /// Whether the database could not be reached (as opposed to refusing the statement).
        unreachable: bool,
        /// Whether the failed statement may have taken effect.
        ambiguous: bool,
        /// The driver's or the pool's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store replied with something this version does not understand.
    #[error("unexpected reply for lock {name:?}: {detail}")]
    Protocol {
        /// The lock name.
        name: String,
        /// What was unexpected.
        detail: String,
    },
}

fn fmt_retry(retry_after: Option<Duration>) -> String {
    match retry_after {
        Some(d) => format!(" (lease ends in {d:?})"),
        None => String::new(),
    }
}

impl LockError {
    /// Whether the error means the store could not be reached (as opposed to an answer).
    ///
    /// ```
    /// use distlock::LockError;
    /// let err = LockError::Held { name: "x".into(), retry_after: None };
    /// assert!(!err.is_unavailable());
    /// ```
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            LockError::Unavailable { .. }
                | LockError::NoQuorum { .. }
                | LockError::NotReplicated { .. }
                | LockError::Database {
                    unreachable: true,
                    ..
                }
        )
    }

    /// Maps a Redis error to `Unavailable` (connection, timeout, cluster or failover states that a
    /// retry may fix) or `Redis` (an answer that a retry will not change).
    pub(crate) fn from_redis(name: &str, ambiguous: bool, source: redis::RedisError) -> Self {
        use redis::{ErrorKind, ServerErrorKind};
        let transient = match source.kind() {
            ErrorKind::Server(kind) => {
                matches!(
                    kind,
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                ) || at_max_clients(&source)
            }
            ErrorKind::Extension => matches!(source.code(), Some("BUSY") | Some("NOREPLICAS")),
            // A reply cut off by the end of its connection reads as a parse error: the
            // connection dropped mid-reply, and the command may have run.
            ErrorKind::Parse => cut_off(&source),
            ErrorKind::UnexpectedReturnType => false,
            _ => true,
        };
        if transient {
            // Only a command that may have reached the server can have taken effect: a refused
            // connection never sent it, and an error reply means the server did not run it.
            let answered = matches!(source.kind(), ErrorKind::Server(_) | ErrorKind::Extension);
            let ambiguous = ambiguous && !answered && !source.is_connection_refusal();
            LockError::Unavailable {
                name: name.to_owned(),
                ambiguous,
                source,
            }
        } else {
            LockError::Redis {
                name: name.to_owned(),
                source,
            }
        }
    }

    pub(crate) fn timeout(name: &str, ambiguous: bool, after: Duration) -> Self {
        let io = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no reply within {after:?}"),
        );
        LockError::Unavailable {
            name: name.to_owned(),
            ambiguous,
            source: redis::RedisError::from(io),
        }
    }

    /// An acquisition's reply handled `after` its sending, when its lease could no longer be
    /// proven: as ambiguous as a timeout (the lock it took is cleaned up).
    pub(crate) fn late(name: &str, after: Duration) -> Self {
        let io = std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the reply was handled {after:?} after sending, past the lease"),
        );
        LockError::Unavailable {
            name: name.to_owned(),
            ambiguous: true,
            source: redis::RedisError::from(io),
        }
    }

    pub(crate) fn broken(name: &str, detail: impl Into<String>) -> Self {
        LockError::BrokenRecord {
            name: name.to_owned(),
            detail: detail.into(),
        }
    }

    pub(crate) fn protocol(name: &str, detail: impl Into<String>) -> Self {
        LockError::Protocol {
            name: name.to_owned(),
            detail: detail.into(),
        }
    }

    /// The error of a cleanup that could not be sent: an ambiguous `Unavailable`, so that the
    /// caller's cleanup retries it (whatever the error was, the lock may be held).
    pub(crate) fn into_ambiguous_unavailable(self) -> Self {
        match self {
            LockError::Unavailable { name, source, .. } | LockError::Redis { name, source } => {
                LockError::Unavailable {
                    name,
                    ambiguous: true,
                    source,
                }
            }
            other => other,
        }
    }

    /// Marks an `Unavailable` error as ambiguous (the command may have taken effect).
    pub(crate) fn into_ambiguous(self) -> Self {
        match self {
            LockError::Unavailable { name, source, .. } => LockError::Unavailable {
                name,
                ambiguous: true,
                source,
            },
            other => other,
        }
    }
}

/// Why a lease is no longer held.
///
/// ```
/// use distlock::LossReason;
/// assert_eq!(LossReason::Expired.to_string(), "no renewal was confirmed before the lease ran out");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// No acquisition or renewal was confirmed recently enough: the lease ran out (minus the drift
    /// allowance) while the store was slow or unreachable.
    Expired,
    /// A renewal found the lock gone or owned by someone else.
    NotOwner,
    /// The configured cap on the total hold time was reached.
    HoldLimit,
    /// The holder released the lock (or completed it): not a failure, but the lease is over.
    Released,
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossReason::Expired => "no renewal was confirmed before the lease ran out",
            LossReason::NotOwner => "the lock is gone or owned by someone else",
            LossReason::HoldLimit => "the hold time cap was reached",
            LossReason::Released => "the lock was released by its holder",
        })
    }
}

/// A Redis at `maxclients` answers a new connection's first command with "ERR max number of
/// clients reached" (a reconnecting client meets it): the store is out of reach for now, the
/// command did not run; not a command it refused.
fn at_max_clients(source: &redis::RedisError) -> bool {
    source
        .detail()
        .is_some_and(|d| d.starts_with("max number of clients reached"))
}

/// Whether a parse error is a reply the connection's end cut short (the parser met the end of
/// its input), not a reply that does not parse.
fn cut_off(error: &redis::RedisError) -> bool {
    error.to_string().contains("end of input")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_cut_short_is_unavailable_and_a_malformed_one_is_not() {
        // What the async connection's decoder reports when its connection ends after the
        // start of an array of four (`tests/layer_redis.rs` meets it through a real socket).
        let parse =
            |text: &str| redis::RedisError::from(redis::ParsingError::from(text.to_owned()));
        let cut = parse("Parse error at 0\nUnexpected end of input\nexpected 3 more elements");
        assert_eq!(cut.kind(), redis::ErrorKind::Parse, "{cut}");
        match LockError::from_redis("k", true, cut) {
            LockError::Unavailable { ambiguous, .. } => assert!(ambiguous, "it may have run"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        let malformed = parse("Parse error at 0\nUnexpected `?`");
        assert!(matches!(
            LockError::from_redis("k", true, malformed),
            LockError::Redis { .. }
        ));
    }

    #[test]
    fn a_redis_at_maxclients_is_unavailable_and_nothing_ran() {
        let full = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "ERR",
            "max number of clients reached".to_owned(),
        ));
        match LockError::from_redis("k", true, full) {
            LockError::Unavailable { ambiguous, .. } => assert!(!ambiguous, "nothing ran"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn io_errors_are_unavailable_and_script_errors_are_not() {
        let io =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(LockError::from_redis("k", false, io).is_unavailable());
        let wrongtype = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "WRONGTYPE",
        ));
        assert!(matches!(
            LockError::from_redis("k", false, wrongtype),
            LockError::Redis { .. }
        ));
    }

    #[test]
    fn only_a_command_that_may_have_run_is_ambiguous() {
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let reset =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let loading = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "LOADING",
        ));
        for (error, ambiguous) in [(refused, false), (reset, true), (loading, false)] {
            match LockError::from_redis("k", true, error) {
                LockError::Unavailable { ambiguous: a, .. } => assert_eq!(a, ambiguous),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn timeout_is_unavailable_and_keeps_ambiguity() {
        let err = LockError::timeout("k", false, Duration::from_millis(5)).into_ambiguous();
        match err {
            LockError::Unavailable {
                ambiguous, source, ..
            } => {
                assert!(ambiguous);
                assert!(source.is_timeout());
            }
            other => panic!("{other:?}"),
        }
    }
}
