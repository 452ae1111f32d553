//! Operating the layer: what happened to a key, clearing it, and what has been running for too
//! long. Store names are keyed hashes under the server secret, so nothing outside the process
//! can find a key's record: these take what identifies a request (method, route template,
//! principal, key), derive its names under the layer's secrets (current and previous), and
//! read the store. `tower-idempotency-cli` does the same from a shell.
//!
//! | call | what |
//! |---|---|
//! | [`IdempotencyLayer::inspect`] | absent; in flight (lease left, fence, since when); completed (status, body size, stored at, expires at, outcome unknown or not) |
//! | [`IdempotencyLayer::purge`] | deletes the stored outcomes, so that the next request runs the handler; never one in flight (its holder goes on and stores its outcome: purge again once it ended) |
//! | [`IdempotencyLayer::in_flight`] | every execution holding a lease for longer than a given age |

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use distlock::once::{Inspection, Purged};
use distlock::{LockError, Once};
use http::StatusCode;

use crate::IdempotencyLayer;
use crate::key::{KeyKind, RouteTemplate};
use crate::record::{Kind, Part, Sealer};
use crate::scope::{Naming, derive};

/// What identifies a request to an operator: the method, the route template (as the router
/// matched it: `/orders/{id}/pay`), the principal its key is scoped to (`None` for global
/// keys), and the key as the client or the request carried it.
///
/// ```
/// use tower_idempotency::operate::RequestKey;
/// let signup = RequestKey::new(http::Method::POST, "/signup", "+15550100");
/// let payment = RequestKey::new(http::Method::POST, "/payments", "8e03978e").principal("customer-42");
/// # let _ = (signup, payment);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestKey {
    method: http::Method,
    route: String,
    principal: Option<String>,
    key: String,
}

impl RequestKey {
    /// A global key (`None` principal) of `method` on `route`.
    pub fn new(method: http::Method, route: impl Into<String>, key: impl Into<String>) -> Self {
        RequestKey {
            method,
            route: route.into(),
            principal: None,
            key: key.into(),
        }
    }

    /// The principal the key is scoped to.
    #[must_use]
    pub fn principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    /// The request parts the scope derives from.
    fn parts(&self) -> http::request::Parts {
        let mut parts = http::Request::new(()).into_parts().0;
        parts.method = self.method.clone();
        parts.extensions.insert(RouteTemplate(self.route.clone()));
        parts
    }
}

/// What the store holds for a key: see [`IdempotencyLayer::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyState {
    /// Executions holding a lease for the key.
    pub in_flight: Vec<InFlight>,
    /// Stored outcomes: one for a key the client chose for one request, one per distinct
    /// request for a key that names a thing.
    pub completed: Vec<Completed>,
}

impl KeyState {
    /// Nothing is stored for the key.
    pub fn is_absent(&self) -> bool {
        self.in_flight.is_empty() && self.completed.is_empty()
    }
}

/// An execution holding a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlight {
    /// The store name (a keyed hash: never the key).
    pub name: String,
    /// The lease left.
    pub lease_left: Option<Duration>,
    /// Its fencing token.
    pub fence: u64,
    /// Since when it holds the lease, by the clock of the instance that runs it.
    pub since: Option<SystemTime>,
}

/// A stored outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completed {
    /// The store name (a keyed hash: never the key).
    pub name: String,
    /// The response's status (500 for an outcome unknown).
    pub status: StatusCode,
    /// The stored body's length, if the body was kept.
    pub body_len: Option<u64>,
    /// The outcome is unknown (the handler panicked, failed, was cut short): retries get
    /// `outcome-unknown`.
    pub outcome_unknown: bool,
    /// The fencing token of the execution that stored it.
    pub fence: u64,
    /// When it was stored (its expiry less the layer's retention).
    pub stored_at: Option<SystemTime>,
    /// When it expires.
    pub expires_at: Option<SystemTime>,
}

/// What [`IdempotencyLayer::purge`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Purge {
    /// Outcomes deleted.
    pub deleted: usize,
    /// Executions in flight, left alone: each stores its outcome when it ends.
    pub in_flight: Vec<InFlight>,
}

/// Why an operation on the store failed: it cannot be reached, it does not offer it (Redlock),
/// or a stored outcome cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperateError {
    /// The store failed or refused.
    #[error(transparent)]
    Store(#[from] LockError),
    /// A stored outcome does not open (another secret, or damaged).
    #[error("the stored outcome {name} cannot be read: {reason}")]
    Unreadable {
        /// Its store name.
        name: String,
        /// Why.
        reason: String,
    },
}

impl IdempotencyLayer {
    /// The names `request`'s outcomes have under each configured secret (current first), with
    /// the record key of each: a per-request key's one name, or every record of a thing (found
    /// by scanning its name's prefix).
    async fn names(
        &self,
        request: &RequestKey,
    ) -> Result<Vec<(String, Option<[u8; 32]>)>, OperateError> {
        let config = self.config();
        let parts = request.parts();
        let principal = request.principal.as_deref();
        let mut names = Vec::new();
        let secrets = std::iter::once(&config.keys).chain(&config.previous);
        for keys in secrets {
            match config.kind {
                KeyKind::Thing => {
                    let thing = derive(
                        keys,
                        &parts,
                        principal,
                        &request.key,
                        Naming::Thing,
                        config.seal,
                    );
                    let client = config.store.client();
                    for name in client.scan(&format!("{}.*", thing.name)).await? {
                        names.push((name, thing.record_key));
                    }
                }
                _ => {
                    let derived = derive(
                        keys,
                        &parts,
                        principal,
                        &request.key,
                        Naming::Key,
                        config.seal,
                    );
                    names.push((derived.name, derived.record_key));
                }
            }
        }
        Ok(names)
    }

    fn once(&self, name: &str) -> Result<Once, OperateError> {
        let once = (self.config().store.client().once(name)).map_err(LockError::from)?;
        Ok(once)
    }

    /// What the store holds for `request`'s key: executions in flight, and stored outcomes
    /// (for a key that names a thing, every outcome about the thing). Under every configured
    /// secret, current and previous.
    ///
    /// # Errors
    /// The store cannot be reached or does not offer it (Redlock); a stored outcome does not
    /// open.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, Store, operate::RequestKey};
    /// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build()?;
    /// let state = layer.inspect(&RequestKey::new(http::Method::POST, "/payments", "k-1")).await?;
    /// assert!(state.is_absent());
    /// # Ok(()) }
    /// ```
    pub async fn inspect(&self, request: &RequestKey) -> Result<KeyState, OperateError> {
        let mut state = KeyState {
            in_flight: Vec::new(),
            completed: Vec::new(),
        };
        for (name, record_key) in self.names(request).await? {
            let once = self.once(&name)?;
            let inspection = once.inspect().await?;
            if let Some(holder) = &inspection.holder {
                state.in_flight.push(InFlight {
                    name: name.clone(),
                    lease_left: holder.lease_left,
                    fence: holder.fence,
                    since: holder.since,
                });
            }
            if let Some(completed) = self
                .completed(&once, &name, record_key.as_ref(), &inspection)
                .await?
            {
                state.completed.push(completed);
            }
        }
        Ok(state)
    }

    /// A stored outcome, opened.
    async fn completed(
        &self,
        once: &Once,
        name: &str,
        record_key: Option<&[u8; 32]>,
        inspection: &Inspection,
    ) -> Result<Option<Completed>, OperateError> {
        let Some(record) = &inspection.record else {
            return Ok(None);
        };
        let unreadable = |reason: String| OperateError::Unreadable {
            name: name.to_owned(),
            reason,
        };
        let sealer = Sealer::of(record_key, name);
        let (head, body_len) = match sealer.open_part(0, 0, record.first()).map_err(unreadable)? {
            Part::Whole(whole) => {
                let kept = whole.head.kind == Kind::Response;
                (whole.head, kept.then_some(whole.body.len() as u64))
            }
            Part::Head(head) => {
                // A streamed record: its end says whether the body was kept, and its length.
                let end = record.parts() - 1;
                let last: Option<Bytes> = once.parts(end, 1).await?.into_parts().into_iter().next();
                let last = last.ok_or_else(|| unreadable("its last part is missing".into()))?;
                let len = match sealer
                    .open_part(end, head.fence, &last)
                    .map_err(unreadable)?
                {
                    Part::End {
                        kept: true, len, ..
                    } => Some(len),
                    _ => None,
                };
                (head, len)
            }
            _ => return Err(unreadable("it starts with the wrong part".into())),
        };
        let now = SystemTime::now();
        let expires_at = inspection.expires_in.map(|left| now + left);
        let retention = self.config().retention;
        Ok(Some(Completed {
            name: name.to_owned(),
            status: head.status,
            body_len,
            outcome_unknown: head.kind == Kind::Unknown,
            fence: head.fence,
            stored_at: expires_at.and_then(|at| at.checked_sub(retention)),
            expires_at,
        }))
    }

    /// Deletes the stored outcomes of `request`'s key (for a key that names a thing, every
    /// outcome about the thing), so that the next request with it runs the handler: for an
    /// operator who has reconciled an outcome (an `outcome-unknown` whose fencing token shows
    /// the work was not done, say). An execution in flight is never touched: a second one could
    /// otherwise start beside it; it goes on, stores its outcome, and is reported here.
    ///
    /// # Errors
    /// The store cannot be reached or does not offer it (Redlock).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{IdempotencyLayer, Store, operate::RequestKey};
    /// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build()?;
    /// let purged = layer.purge(&RequestKey::new(http::Method::POST, "/payments", "k-1")).await?;
    /// assert_eq!(purged.deleted, 0);
    /// # Ok(()) }
    /// ```
    pub async fn purge(&self, request: &RequestKey) -> Result<Purge, OperateError> {
        let mut purge = Purge::default();
        for (name, _) in self.names(request).await? {
            let purged = self.once(&name)?.purge().await?;
            // This instance's replay cache forgets it now (the others hear it from Redis).
            if let Some(cache) = self.config().store.cache() {
                cache.remove(&name);
            }
            match purged {
                Purged::Deleted => purge.deleted += 1,
                Purged::InFlight { lease_left } => purge.in_flight.push(InFlight {
                    name,
                    lease_left,
                    fence: 0,
                    since: None,
                }),
                _ => {}
            }
        }
        Ok(purge)
    }

    /// Every execution on this layer's store (its prefix: every layer sharing it) that has held
    /// its lease for longer than `older_than`, oldest first: a handler stuck on a call that
    /// never returns, say. Found by scanning the store (`SCAN` on Redis, every master of a
    /// Cluster), so it costs a pass over the store's keys.
    ///
    /// # Errors
    /// The store cannot be reached or does not offer it (Redlock).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, Store};
    /// let layer = IdempotencyLayer::builder(Store::memory()).global_keys().build()?;
    /// assert!(layer.in_flight(Duration::from_secs(30)).await?.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>, OperateError> {
        let client = self.config().store.client();
        let now = SystemTime::now();
        let mut found = Vec::new();
        for name in client.scan("*").await? {
            let inspection = self.once(&name)?.inspect().await?;
            let Some(holder) = inspection.holder else {
                continue;
            };
            // Only executions: a thing's own lock (no start recorded) is held by one of them.
            let Some(since) = holder.since else { continue };
            if now.duration_since(since).unwrap_or_default() >= older_than {
                found.push(InFlight {
                    name,
                    lease_left: holder.lease_left,
                    fence: holder.fence,
                    since: Some(since),
                });
            }
        }
        found.sort_by_key(|f| f.since);
        Ok(found)
    }
}
