//! A connection that follows the master of a Sentinel-managed group across failovers.
//!
//! [`SentinelConnection`] asks the sentinels for the current master and keeps one multiplexed
//! connection to it. It drops that connection when the sentinels announce `+switch-master`, and
//! after a connection error, a `READONLY` answer (the old master was demoted) or `MASTERDOWN`;
//! the next command asks the sentinels again. The failed command itself is not retried: its
//! outcome is unknown, and the lock treats it as such.
//!
//! **What a failover costs.** Replication is asynchronous: a lock (or a fencing counter, or a
//! record) written on the old master shortly before it failed may not have reached the replica
//! that is promoted. Then, after the failover, the lock is simply gone: another client can take
//! it while the first holder still runs, and a fencing counter may start lower. The first
//! holder's next renewal finds the lock gone and fires its loss signal
//! ([`LossReason::NotOwner`](crate::LossReason::NotOwner)), so it learns within one renewal
//! interval. An old master the sentinels could not reach may also keep accepting writes for a
//! while (renewals nobody will see). [`LockClientBuilder::replicas`](crate::LockClientBuilder::replicas)
//! closes much of this (`WAIT` for replicas after acquiring, renewing and completing: a write
//! no replica saw counts as failed) without closing all of it: `WAIT` is not consensus. Use
//! Redlock across independent masters when the lock must survive the loss of a master.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};

use crate::ConfigError;

/// A `ConnectionLike` to the current master of a Sentinel-managed group. Cheap to clone; all
/// clones share one connection. See the [module docs](self).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock::ConfigError> {
/// let conn = distlock::sentinel::SentinelConnection::new(
///     &["redis://127.0.0.1:26379/", "redis://127.0.0.1:26380/"],
///     "mymaster",
/// )?;
/// let client = distlock::LockClient::builder().redis(conn)?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SentinelConnection {
    inner: Arc<Inner>,
}

struct Inner {
    sentinel: Arc<tokio::sync::Mutex<SentinelClient>>,
    service: String,
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    connecting: tokio::sync::Mutex<u64>,
    timeout: Duration,
    watching: AtomicBool,
    /// Since when a command on the connection of this generation went unanswered (its caller
    /// gave up) with no reply on that connection since: a hung master.
    /// (generation, since, commands given up since).
    silent: Mutex<Option<(u64, std::time::Instant, u32)>>,
}

impl Inner {
    fn forget(&self) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl std::fmt::Debug for SentinelConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConnection").finish_non_exhaustive()
    }
}

impl SentinelConnection {
    /// A connection to the master named `service`, found through `sentinels`. Connects on first
    /// use. The same as [`builder`](Self::builder)`(sentinels, service).build()`.
    ///
    /// # Errors
    /// If a sentinel URL is invalid.
    ///
    /// ```
    /// assert!(distlock::sentinel::SentinelConnection::new(&["not a url"], "m").is_err());
    /// ```
    pub fn new<S: AsRef<str>>(sentinels: &[S], service: &str) -> Result<Self, ConfigError> {
        Self::builder(sentinels, service).build()
    }

    /// A builder, for TLS and the master's credentials. Credentials in the sentinel URLs
    /// (`redis://user:password@host:port/`) log in to the sentinels; the master's are separate
    /// ([`SentinelConnectionBuilder::master_auth`]).
    ///
    /// ```
    /// # fn main() -> Result<(), distlock::ConfigError> {
    /// let conn = distlock::sentinel::SentinelConnection::builder(
    ///     &["rediss://127.0.0.1:26379/"],
    ///     "mymaster",
    /// )
    /// .master_auth(Some("locks"), "secret")
    /// .build()?;
    /// # let _ = conn;
    /// # Ok(()) }
    /// ```
    pub fn builder<S: AsRef<str>>(sentinels: &[S], service: &str) -> SentinelConnectionBuilder {
        SentinelConnectionBuilder {
            sentinels: sentinels.iter().map(|s| s.as_ref().to_owned()).collect(),
            service: service.to_owned(),
            tls: None,
            master_tls: None,
            master_auth: None,
        }
    }

    /// The sentinel client, shared with the notification task.
    pub(crate) fn sentinel(&self) -> Arc<tokio::sync::Mutex<SentinelClient>> {
        self.inner.sentinel.clone()
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    async fn connection(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if !self.inner.watching.swap(true, Ordering::Relaxed) {
            tokio::spawn(watch_switches(Arc::downgrade(&self.inner)));
        }
        self.abandon_if_hung();
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let mut generation = self.inner.connecting.lock().await;
        if let Some(current) = self.current() {
            return Ok(current);
        }
        let connect = async {
            let client = self.inner.sentinel.lock().await.async_get_client().await?;
            // The lock applies its own per-command timeout.
            let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await
        };
        let conn = match tokio::time::timeout(self.inner.timeout, connect).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no master through the sentinels in time",
                )));
            }
        };
        *generation += 1;
        let current = (*generation, conn);
        *self.inner.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(current.clone());
        Ok(current)
    }

    /// A master that stopped answering (frozen, or cut off by a network that drops packets)
    /// produces no error: callers time out and drop their commands. When the connection has
    /// left commands unanswered for longer than the connect timeout, with no reply since, it
    /// is abandoned and the sentinels are asked again, whether or not `+switch-master` came.
    fn abandon_if_hung(&self) {
        let silent = *self.inner.silent.lock().unwrap_or_else(|e| e.into_inner());
        // Two commands given up and no reply between them over the timeout: not one caller's
        // cancellation on an idle connection, a master that does not answer.
        if let Some((generation, since, given_up)) = silent
            && given_up >= 2
            && since.elapsed() >= self.inner.timeout
        {
            let mut current = self.inner.current.lock().unwrap_or_else(|e| e.into_inner());
            if current.as_ref().is_some_and(|(g, _)| *g == generation) {
                tracing::warn!(
                    service = %self.inner.service,
                    "sentinel: the master has not answered for {:?}; reconnecting",
                    since.elapsed()
                );
                *current = None;
            }
            *self.inner.silent.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    /// Records that the connection of `generation` answered (or went silent, when `answered`
    /// is false and a command was given up).
    fn heard(&self, generation: u64, answered: bool) {
        let mut silent = self.inner.silent.lock().unwrap_or_else(|e| e.into_inner());
        match (&mut *silent, answered) {
            (Some((g, _, _)), true) if *g == generation => *silent = None,
            (Some((g, _, given_up)), false) if *g == generation => *given_up += 1,
            (_, false) => *silent = Some((generation, std::time::Instant::now(), 1)),
            _ => {}
        }
    }

    /// Forgets the connection of `generation` after an error that means it no longer reaches
    /// the master; the next command asks the sentinels again.
    fn check(&self, generation: u64, error: &RedisError) {
        let stale = error.is_io_error()
            || error.is_connection_dropped()
            || error.is_connection_refusal()
            || error.is_timeout()
            || matches!(
                error.kind(),
                ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
            );
        if stale {
            let mut current = self.inner.current.lock().unwrap_or_else(|e| e.into_inner());
            if current.as_ref().is_some_and(|(g, _)| *g == generation) {
                *current = None;
            }
        }
    }
}

/// Builder for [`SentinelConnection`]: TLS and the master's credentials.
#[must_use]
pub struct SentinelConnectionBuilder {
    sentinels: Vec<String>,
    service: String,
    tls: Option<crate::Tls>,
    master_tls: Option<bool>,
    master_auth: Option<(Option<String>, String)>,
}

impl std::fmt::Debug for SentinelConnectionBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConnectionBuilder")
            .field("sentinels", &self.sentinels.len())
            .field("service", &self.service)
            .field("tls", &self.tls)
            .field("master_tls", &self.master_tls)
            .field("master_user", &self.master_auth.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl SentinelConnectionBuilder {
    /// Trusted roots and client certificate for `rediss://` sentinels and a TLS master.
    ///
    /// ```
    /// let b = distlock::sentinel::SentinelConnection::builder(&["rediss://127.0.0.1:26379/"], "m")
    ///     .tls(distlock::Tls::new());
    /// ```
    pub fn tls(mut self, tls: crate::Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    pub(crate) fn default_tls(mut self, tls: crate::Tls) -> Self {
        self.tls.get_or_insert(tls);
        self
    }

    pub(crate) fn service(&self) -> &str {
        &self.service
    }

    /// Whether the master (and the replicas the sentinels name) are reached over TLS. Default:
    /// when the sentinel URLs are `rediss://`.
    ///
    /// ```
    /// let b = distlock::sentinel::SentinelConnection::builder(&["redis://127.0.0.1:26379/"], "m")
    ///     .master_tls(true);
    /// ```
    pub fn master_tls(mut self, tls: bool) -> Self {
        self.master_tls = Some(tls);
        self
    }

    /// Log in to the master as `username` (or the default user) with `password`: an ACL user
    /// with the rights the lock needs (see [the crate docs](crate#acl)).
    ///
    /// ```
    /// let b = distlock::sentinel::SentinelConnection::builder(&["redis://127.0.0.1:26379/"], "m")
    ///     .master_auth(Some("locks"), "secret");
    /// ```
    pub fn master_auth(mut self, username: Option<&str>, password: &str) -> Self {
        self.master_auth = Some((username.map(str::to_owned), password.to_owned()));
        self
    }

    /// The connection (it connects on first use).
    ///
    /// # Errors
    /// If there is no sentinel, a sentinel URL is invalid, the sentinels mix `redis://` and
    /// `rediss://`, or TLS settings are given for plain connections only.
    ///
    /// ```
    /// let b = distlock::sentinel::SentinelConnection::builder(&["redis://127.0.0.1:26379/"], "m");
    /// assert!(b.build().is_ok());
    /// ```
    pub fn build(self) -> Result<SentinelConnection, ConfigError> {
        let invalid = |e: RedisError| ConfigError::invalid("sentinel", e.to_string());
        if self.sentinels.is_empty() {
            return Err(ConfigError::invalid(
                "sentinel",
                "at least one sentinel is needed",
            ));
        }
        let mut infos = Vec::with_capacity(self.sentinels.len());
        for url in &self.sentinels {
            let info =
                redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(|e| {
                    ConfigError::invalid("sentinel", format!("{}: {e}", crate::redact_url(url)))
                })?;
            infos.push(info);
        }
        let tls_sentinels = infos.iter().filter(|i| crate::tls::is_tls(i)).count();
        if tls_sentinels != 0 && tls_sentinels != infos.len() {
            return Err(ConfigError::invalid(
                "sentinel",
                "the sentinel URLs mix redis:// and rediss://",
            ));
        }
        let sentinel_tls = tls_sentinels != 0;
        let master_tls = self.master_tls.unwrap_or(sentinel_tls);
        if self.tls.is_some() && !sentinel_tls && !master_tls {
            return Err(ConfigError::invalid(
                "sentinel",
                "TLS settings were given, but neither the sentinels (rediss://) nor the master use TLS",
            ));
        }
        if sentinel_tls || master_tls {
            crate::tls::ensure_crypto_provider();
        }
        let first = infos[0].redis_settings().clone();
        let addrs: Vec<redis::ConnectionAddr> = infos.iter().map(|i| i.addr().clone()).collect();
        let mut builder = redis::sentinel::SentinelClientBuilder::new(
            addrs,
            self.service.as_str(),
            SentinelServerType::Master,
        )
        .map_err(invalid)?;
        if let Some(username) = first.username() {
            builder = builder.set_client_to_sentinel_username(username);
        }
        if let Some(password) = first.password() {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(tls) = &self.tls {
            if sentinel_tls {
                builder = builder.set_client_to_sentinel_certificates(tls.certificates());
            }
            if master_tls {
                builder = builder.set_client_to_redis_certificates(tls.certificates());
            }
        }
        if master_tls {
            builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
        }
        if let Some((username, password)) = &self.master_auth {
            if let Some(username) = username {
                builder = builder.set_client_to_redis_username(username);
            }
            builder = builder.set_client_to_redis_password(password);
        }
        let client = builder.build().map_err(invalid)?;
        Ok(SentinelConnection {
            inner: Arc::new(Inner {
                sentinel: Arc::new(tokio::sync::Mutex::new(client)),
                service: self.service,
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(0),
                timeout: Duration::from_secs(2),
                watching: AtomicBool::new(false),
                silent: Mutex::new(None),
            }),
        })
    }
}

/// Follows the sentinels' `+switch-master` announcements: when our group's master changes, the
/// connection to the old one is dropped at once, rather than at the first error (an old master
/// that was not reachable by the sentinels may still accept writes nobody will see).
async fn watch_switches(inner: Weak<Inner>) {
    let mut backoff = crate::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let sentinel = strong.sentinel.clone();
        let service = strong.service.clone();
        drop(strong);
        let subscribed = async {
            let client = sentinel.lock().await.async_get_sentinel_client().await?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            redis::RedisResult::Ok(pubsub)
        };
        if let Ok(Ok(pubsub)) = tokio::time::timeout(Duration::from_secs(5), subscribed).await {
            backoff.reset();
            let mut messages = pubsub.into_on_message();
            loop {
                tokio::select! {
                    message = messages.next() => match message {
                        Some(message) => {
                            let payload: String = message.get_payload().unwrap_or_default();
                            if payload.split(' ').next() == Some(service.as_str()) {
                                let Some(strong) = inner.upgrade() else { return };
                                tracing::info!(%payload, "sentinel: master switched; reconnecting");
                                strong.forget();
                            }
                        }
                        None => break,
                    },
                    () = tokio::time::sleep(Duration::from_secs(1)) => {
                        if inner.strong_count() == 0 {
                            return;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// A command in flight: if its future is dropped before an answer (the caller's timeout), the
/// connection is marked silent since then.
struct Unanswered<'a> {
    connection: &'a SentinelConnection,
    generation: u64,
    done: bool,
}

impl<'a> Unanswered<'a> {
    fn new(connection: &'a SentinelConnection, generation: u64) -> Self {
        Unanswered {
            connection,
            generation,
            done: false,
        }
    }

    /// An answer came (a reply, or an error the server sent): the connection is alive.
    fn answered<T>(mut self, result: &Result<T, RedisError>) {
        self.done = true;
        let from_server = match result {
            Ok(_) => true,
            Err(e) => !(e.is_io_error() || e.is_timeout() || e.is_connection_dropped()),
        };
        if from_server {
            self.connection.heard(self.generation, true);
        }
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.connection.heard(self.generation, false);
        }
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let watch = Unanswered::new(self, generation);
            let result = conn.req_packed_command(cmd).await;
            watch.answered(&result);
            if let Err(e) = &result {
                self.check(generation, e);
            }
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.connection().await?;
            let watch = Unanswered::new(self, generation);
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            watch.answered(&result);
            if let Err(e) = &result {
                self.check(generation, e);
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
