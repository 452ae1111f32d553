//! The lock on one Redis (standalone, a Sentinel-managed master, or a Redis Cluster): every
//! operation is one `EVALSHA` of a script from `scripts/`, generic over any
//! `redis::aio::ConnectionLike` that can be cloned (multiplexed, managed or cluster connections).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use redis::aio::ConnectionLike;
use redis::{Cmd, Script, Value};

use super::waiters::Waiters;
use super::{Attempt, Backend, BoxFuture, Mode, Op, millis};
use crate::LockError;

mod notify;
mod scripts;

pub(crate) use notify::{Source, spawn_notifiers};
use scripts::SCRIPTS;

/// A connection Redis lock operations can be sent on.
pub(crate) trait Conn: ConnectionLike + Clone + Send + Sync + 'static {}
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Conn for C {}

pub(crate) struct RedisBackend<C> {
    conn: C,
    waiters: Arc<Waiters>,
    describe: String,
    /// Replicas that must acknowledge an acquisition (`WAIT`), and how long to wait for them.
    replicas: Option<(usize, Duration)>,
}

impl<C> std::fmt::Debug for RedisBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

impl<C: Conn> RedisBackend<C> {
    pub(crate) fn new(conn: C, waiters: Arc<Waiters>, describe: String) -> Self {
        RedisBackend {
            conn,
            waiters,
            describe,
            replicas: None,
        }
    }

    pub(crate) fn with_replicas(mut self, replicas: Option<(usize, Duration)>) -> Self {
        self.replicas = replicas;
        self
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn bytes(v: Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::from(b)),
        Value::SimpleString(s) => Some(Bytes::from(s)),
        _ => None,
    }
}

/// Parses the reply of the acquire scripts: `{1, fence}`, `{0, pttl[, tag]}` or `{2, record}`.
pub(crate) fn parse_attempt(name: &str, reply: Value) -> Result<Attempt, LockError> {
    let bad = |detail: &str| LockError::protocol(name, format!("acquire: {detail}"));
    let Value::Array(items) = reply else {
        return Err(bad("not an array"));
    };
    let mut items = items.into_iter();
    let status = items
        .next()
        .as_ref()
        .and_then(int)
        .ok_or_else(|| bad("no status"))?;
    match status {
        1 => {
            let fence = items
                .next()
                .as_ref()
                .and_then(int)
                .ok_or_else(|| bad("no fence"))?;
            let fence = u64::try_from(fence).map_err(|_| bad("negative fence"))?;
            Ok(Attempt::Acquired { fence })
        }
        0 => {
            let pttl = items
                .next()
                .as_ref()
                .and_then(int)
                .ok_or_else(|| bad("no ttl"))?;
            let ttl = match pttl {
                // The key has no expiry: someone set it without a lease.
                -1 => None,
                // Gone since the check: free now.
                p if p < 0 => Some(Duration::ZERO),
                p => Some(Duration::from_millis(p as u64)),
            };
            let tag = items.next().and_then(bytes);
            Ok(Attempt::Held { ttl, tag })
        }
        2 => {
            let record = items
                .next()
                .and_then(bytes)
                .ok_or_else(|| bad("no record"))?;
            Ok(Attempt::Done { record })
        }
        other => Err(bad(&format!("unknown status {other}"))),
    }
}

fn parse_flag(name: &str, what: &str, reply: Value) -> Result<bool, LockError> {
    match int(&reply) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(LockError::protocol(
            name,
            format!("{what}: unexpected reply {reply:?}"),
        )),
    }
}

/// An `EVALSHA` of `script` on `keys`; the caller appends the arguments.
fn evalsha(script: &Script, keys: &[&str], args: usize) -> Cmd {
    let mut cmd = Cmd::with_capacity(3 + keys.len() + args, 64 + 48 * (keys.len() + args));
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
    for key in keys {
        cmd.arg(*key);
    }
    cmd
}

/// The reply of the exclusive acquire script: the fence, or `-1 - pttl` when held.
pub(crate) fn parse_acquired(name: &str, reply: Value) -> Result<Attempt, LockError> {
    match int(&reply) {
        Some(fence) if fence >= 1 => Ok(Attempt::Acquired {
            fence: fence as u64,
        }),
        Some(0) => Ok(Attempt::Held {
            ttl: None,
            tag: None,
        }),
        Some(held) => Ok(Attempt::Held {
            ttl: Some(Duration::from_millis((-1 - held) as u64)),
            tag: None,
        }),
        None => Err(LockError::protocol(
            name,
            format!("acquire: unexpected reply {reply:?}"),
        )),
    }
}

impl<C: Conn> RedisBackend<C> {
    /// Sends `cmd` (an `EVALSHA` of `script`); on `NOSCRIPT` (a restarted or new server, a
    /// failover) loads the script and sends it again.
    async fn eval(
        &self,
        op: &Op,
        ambiguous: bool,
        script: &Script,
        cmd: Cmd,
    ) -> Result<Value, LockError> {
        let mut conn = self.conn.clone();
        let first = cmd.query_async::<Value>(&mut conn).await;
        let reply = match first {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                match script.load_async(&mut conn).await {
                    Ok(_) => cmd.query_async::<Value>(&mut conn).await,
                    Err(load) => Err(load),
                }
            }
            other => other,
        };
        reply.map_err(|e| LockError::from_redis(op.name.as_str(), ambiguous, e))
    }

    /// Sends `cmd` and, with the replica check on, `WAIT` right behind it in one pipeline: on
    /// the very connection that wrote. (`WAIT` counts acknowledgements of its own connection's
    /// writes; sent separately, after a reconnect or a Sentinel switch it would go out on a
    /// connection that wrote nothing and pass at once.) Returns the script's reply and, with the
    /// check on, the replicas that acknowledged it (or why `WAIT` failed).
    async fn eval_replicated(
        &self,
        op: &Op,
        ambiguous: bool,
        script: &Script,
        cmd: Cmd,
    ) -> Result<(Value, Option<Result<usize, LockError>>), LockError> {
        let Some((wanted, timeout)) = self.replicas else {
            return Ok((self.eval(op, ambiguous, script, cmd).await?, None));
        };
        let name = op.name.as_str();
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .add_command(cmd)
            .cmd("WAIT")
            .arg(wanted)
            .arg(millis(timeout));
        let mut conn = self.conn.clone();
        let mut loaded = false;
        loop {
            let replies: Vec<Value> = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| LockError::from_redis(name, ambiguous, e))?;
            let [reply, waited] = <[Value; 2]>::try_from(replies)
                .map_err(|r| LockError::protocol(name, format!("pipeline: {} replies", r.len())))?;
            let reply = match reply {
                Value::ServerError(error) => {
                    let error = redis::RedisError::from(error);
                    if error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
                        && !loaded
                    {
                        script
                            .load_async(&mut conn)
                            .await
                            .map_err(|e| LockError::from_redis(name, false, e))?;
                        loaded = true;
                        continue;
                    }
                    return Err(LockError::from_redis(name, false, error));
                }
                reply => reply,
            };
            let acknowledged = match waited {
                Value::Int(n) => Ok(usize::try_from(n).unwrap_or(0)),
                Value::ServerError(error) => Err(LockError::from_redis(
                    name,
                    false,
                    redis::RedisError::from(error),
                )),
                other => Err(LockError::protocol(name, format!("WAIT: {other:?}"))),
            };
            return Ok((reply, Some(acknowledged)));
        }
    }

    /// The outcome of a write's replica check: `Ok` when enough replicas acknowledged it.
    fn replicated(
        &self,
        op: &Op,
        acknowledged: Option<Result<usize, LockError>>,
    ) -> Result<(), LockError> {
        match (acknowledged, self.replicas) {
            (Some(Ok(acknowledged)), Some((wanted, _))) if acknowledged < wanted => {
                Err(LockError::NotReplicated {
                    name: op.name.as_str().to_owned(),
                    acknowledged,
                    wanted,
                })
            }
            (Some(Err(error)), _) => Err(error),
            _ => Ok(()),
        }
    }

    /// An exclusive acquisition without a fencing token: `SET NX PX`, and `PTTL` for the case
    /// it is held, in one round trip and no script.
    async fn acquire_unfenced(&self, op: &Op) -> Result<Attempt, LockError> {
        // One command when the lock is free (the common case); the holder's remaining lease,
        // which paces waiting, costs a second one only when it is not.
        let key = op.name.lock_key();
        let mut conn = self.conn.clone();
        let set: Option<redis::Value> = redis::cmd("SET")
            .arg(key)
            .arg(op.token.as_str())
            .arg("NX")
            .arg("PX")
            .arg(millis(op.lease))
            .query_async(&mut conn)
            .await
            .map_err(|e| LockError::from_redis(op.name.as_str(), true, e))?;
        if set.is_some() {
            return Ok(Attempt::Acquired { fence: 0 });
        }
        let pttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| LockError::from_redis(op.name.as_str(), false, e))?;
        Ok(Attempt::Held {
            ttl: match pttl {
                // Expired between the two commands (-2), or no expiry at all (-1).
                -2 => Some(Duration::ZERO),
                -1 => None,
                p => Some(Duration::from_millis(p.max(0) as u64)),
            },
            tag: None,
        })
    }

    /// (Redlock) Raises this node's fencing counter to `fence` if the lock here is ours.
    pub(crate) async fn fence_sync(&self, op: &Op, fence: u64) -> Result<bool, LockError> {
        let script = &SCRIPTS.fence_sync;
        let mut cmd = evalsha(script, &[op.name.lock_key(), op.name.state_key()], 3);
        match &op.mode {
            Mode::Reentrant { owner } => cmd.arg(owner.as_str()).arg(fence).arg("r"),
            _ => cmd.arg(op.token.as_str()).arg(fence).arg("x"),
        };
        let reply = self.eval(op, false, script, cmd).await?;
        parse_flag(op.name.as_str(), "fence_sync", reply)
    }
}

impl<C: Conn> Backend for RedisBackend<C> {
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            let keys = [op.name.lock_key(), op.name.state_key()];
            let name = op.name.as_str();
            let (attempt, acknowledged) = match &op.mode {
                Mode::Exclusive if !op.fencing && self.replicas.is_none() => {
                    (self.acquire_unfenced(op).await?, None)
                }
                Mode::Exclusive => {
                    let script = &SCRIPTS.acquire;
                    let mut cmd = evalsha(script, &keys, 3);
                    cmd.arg(op.token.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms());
                    let (reply, acknowledged) = self.eval_replicated(op, true, script, cmd).await?;
                    let attempt = match parse_acquired(name, reply)? {
                        // The unfenced kind hands out no fence, even through the script.
                        Attempt::Acquired { .. } if !op.fencing => Attempt::Acquired { fence: 0 },
                        attempt => attempt,
                    };
                    (attempt, acknowledged)
                }
                Mode::Once { tag, .. } => {
                    let script = &SCRIPTS.begin;
                    let mut cmd = evalsha(script, &keys, 4);
                    cmd.arg(op.token.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms())
                        .arg(tag.as_ref());
                    let (reply, acknowledged) = self.eval_replicated(op, true, script, cmd).await?;
                    (parse_attempt(name, reply)?, acknowledged)
                }
                Mode::Reentrant { owner } => {
                    let script = &SCRIPTS.reentrant_acquire;
                    let mut cmd = evalsha(script, &keys, 4);
                    cmd.arg(owner.as_str())
                        .arg(millis(op.lease))
                        .arg(op.state_ttl_ms())
                        .arg(op.token.as_str());
                    let (reply, acknowledged) = self.eval_replicated(op, true, script, cmd).await?;
                    (parse_attempt(name, reply)?, acknowledged)
                }
            };
            if let Attempt::Acquired { .. } = attempt
                && let Err(error) = self.replicated(op, acknowledged)
            {
                // Too few replicas have the lock, or the check itself failed: it does not count,
                // and it must not stay behind for a whole lease.
                if let Err(release) = self.release(op).await {
                    // The cleanup in the caller retries it.
                    return Err(release.into_ambiguous_unavailable());
                }
                return Err(error);
            }
            Ok(attempt)
        })
    }

    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let keys = [op.name.lock_key(), op.name.state_key()];
            let (script, cmd) = match &op.mode {
                Mode::Reentrant { owner } => {
                    let script = &SCRIPTS.reentrant_extend;
                    let mut cmd = evalsha(script, &keys, 4);
                    cmd.arg(owner.as_str())
                        .arg(millis(lease))
                        .arg(op.state_ttl_ms())
                        .arg(op.token.as_str());
                    (script, cmd)
                }
                _ => {
                    let script = &SCRIPTS.extend;
                    let mut cmd = evalsha(script, &keys, 3);
                    cmd.arg(op.token.as_str())
                        .arg(millis(lease))
                        .arg(op.state_ttl_ms());
                    (script, cmd)
                }
            };
            let (reply, acknowledged) = self.eval_replicated(op, false, script, cmd).await?;
            let renewed = parse_flag(op.name.as_str(), "extend", reply)?;
            if renewed {
                // A renewal only the master knows of is worth nothing after a failover.
                self.replicated(op, acknowledged)?;
            }
            Ok(renewed)
        })
    }

    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let (script, cmd) = match &op.mode {
                Mode::Reentrant { owner } => {
                    let script = &SCRIPTS.reentrant_release;
                    let mut cmd = evalsha(script, &[op.name.lock_key()], 2);
                    cmd.arg(owner.as_str()).arg(op.token.as_str());
                    (script, cmd)
                }
                _ => {
                    let script = &SCRIPTS.release;
                    let mut cmd = evalsha(script, &[op.name.lock_key()], 1);
                    cmd.arg(op.token.as_str());
                    (script, cmd)
                }
            };
            let reply = self.eval(op, false, script, cmd).await?;
            parse_flag(op.name.as_str(), "release", reply)
        })
    }

    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let script = &SCRIPTS.complete;
            let mut cmd = evalsha(script, &[op.name.lock_key(), op.name.state_key()], 3);
            cmd.arg(op.token.as_str())
                .arg(record)
                .arg(op.state_ttl_ms());
            let (reply, acknowledged) = self.eval_replicated(op, true, script, cmd).await?;
            let stored = parse_flag(op.name.as_str(), "complete", reply)?;
            if stored {
                self.replicated(op, acknowledged)?;
            }
            Ok(stored)
        })
    }

    fn prepare(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            for script in SCRIPTS.all() {
                script
                    .load_async(&mut conn)
                    .await
                    .map_err(|e| LockError::from_redis("(scripts)", false, e))?;
            }
            Ok(())
        })
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn check_config(&self, config: &crate::LockConfig) -> Result<(), crate::ConfigError> {
        match self.replicas {
            Some((_, timeout)) if timeout >= config.op_timeout() => {
                Err(crate::ConfigError::invalid(
                    "replicas",
                    format!(
                        "the WAIT timeout {timeout:?} must be below the command timeout {:?} (it is part of the same command)",
                        config.op_timeout()
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(v: Vec<Value>) -> Value {
        Value::Array(v)
    }

    #[test]
    fn parses_the_exclusive_acquire_reply() {
        assert_eq!(
            parse_acquired("k", Value::Int(3)).unwrap(),
            Attempt::Acquired { fence: 3 }
        );
        assert_eq!(
            parse_acquired("k", Value::Int(-1 - 1500)).unwrap(),
            Attempt::Held {
                ttl: Some(Duration::from_millis(1500)),
                tag: None
            }
        );
        assert_eq!(
            parse_acquired("k", Value::Int(-1)).unwrap(),
            Attempt::Held {
                ttl: Some(Duration::ZERO),
                tag: None
            }
        );
        assert_eq!(
            parse_acquired("k", Value::Int(0)).unwrap(),
            Attempt::Held {
                ttl: None,
                tag: None
            }
        );
        assert!(parse_acquired("k", Value::Nil).is_err());
    }

    #[test]
    fn parses_every_acquire_reply() {
        assert_eq!(
            parse_attempt("k", arr(vec![Value::Int(1), Value::Int(7)])).unwrap(),
            Attempt::Acquired { fence: 7 }
        );
        assert_eq!(
            parse_attempt("k", arr(vec![Value::Int(0), Value::Int(1500)])).unwrap(),
            Attempt::Held {
                ttl: Some(Duration::from_millis(1500)),
                tag: None
            }
        );
        assert_eq!(
            parse_attempt(
                "k",
                arr(vec![
                    Value::Int(0),
                    Value::Int(-1),
                    Value::BulkString(b"fp".to_vec())
                ])
            )
            .unwrap(),
            Attempt::Held {
                ttl: None,
                tag: Some(Bytes::from_static(b"fp"))
            }
        );
        assert_eq!(
            parse_attempt(
                "k",
                arr(vec![Value::Int(2), Value::BulkString(b"rec".to_vec())])
            )
            .unwrap(),
            Attempt::Done {
                record: Bytes::from_static(b"rec")
            }
        );
    }

    #[test]
    fn malformed_replies_are_protocol_errors() {
        for reply in [
            Value::Nil,
            arr(vec![]),
            arr(vec![Value::Int(1)]),
            arr(vec![Value::Int(1), Value::Int(-3)]),
            arr(vec![Value::Int(9), Value::Int(0)]),
            arr(vec![Value::Int(2)]),
        ] {
            assert!(
                matches!(
                    parse_attempt("k", reply.clone()),
                    Err(LockError::Protocol { .. })
                ),
                "{reply:?}"
            );
        }
        assert!(parse_flag("k", "release", Value::Nil).is_err());
    }
}
