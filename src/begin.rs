//! Before the handler: read the body, find the key and fingerprint, and ask the store, in one
//! round trip, whether to replay, reject or run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use distlock::{Begin, LockError, LockGuard};
use http::request::Parts;
use http::{Request, Response, header};
use http_body::Body;

use crate::body::{BoxError, RequestBody, ResponseBody, read_request};
use crate::fingerprint::identify;
use crate::headers::negotiation;
use crate::layer::{Config, OnConflict};
use crate::metrics::{Event, count, store_latency};
use crate::outcome::DecisionCell;
use crate::problem::html::ForBrowser;
use crate::replay::{Stored, join, replay};
use crate::run::{Held, Run};
use crate::scope::{Naming, derive};
use crate::secret::Keys;
use crate::{IDEMPOTENT_REPLAYED, IdempotencyContext, KeyKind, Rejection};
use tracing::Span;

/// What to do with a request.
pub(crate) enum Decision<B, R> {
    /// Answer without the handler: a rejection or a replay.
    Respond(Response<ResponseBody<R>>),
    /// Call the handler, under a lease (`Some`) or unprotected (`None`).
    Run {
        request: Request<RequestBody<B>>,
        run: Option<Box<Run>>,
    },
}

fn reject<B, R>(config: &Config, span: &Span, rejection: Rejection) -> Decision<B, R> {
    tracing::debug!(%rejection, "idempotency: rejected");
    refused(span, &rejection);
    count(match rejection {
        Rejection::Conflict { .. } => Event::Conflict,
        Rejection::KeyReused => Event::Mismatch,
        Rejection::StoreUnavailable { .. } | Rejection::StoreFull { .. } => Event::StoreError,
        _ => Event::Rejected,
    });
    Decision::Respond(config.problem(&rejection))
}

/// Records a refusal on the request's span.
fn refused(span: &Span, rejection: &Rejection) {
    let decision = match rejection {
        Rejection::Conflict { .. } => "conflict",
        _ => "rejected",
    };
    span.record("decision", decision);
    span.record("reason", rejection.slug());
}

/// Records what answered a request from the store: `served` (a replay, a join), or the
/// refusal the response carries (a key reused, a record that cannot be read).
fn answered<R>(span: &Span, response: &Response<R>, served: &'static str) {
    match response.extensions().get::<Rejection>() {
        Some(rejection) if !response.headers().contains_key(IDEMPOTENT_REPLAYED) => {
            refused(span, rejection)
        }
        _ => {
            span.record("decision", served);
        }
    }
}

fn unprotected<B, R>(
    span: &Span,
    parts: http::request::Parts,
    body: RequestBody<B>,
) -> Decision<B, R> {
    span.record("decision", "passed-through");
    count(Event::Passthrough);
    Decision::Run {
        request: Request::from_parts(parts, body),
        run: None,
    }
}

/// What to do with `request`; a rejection to a person's browser as a page.
pub(crate) async fn begin<B, R>(
    config: Arc<Config>,
    request: Request<B>,
    span: tracing::Span,
) -> Decision<B, R>
where
    B: Body + Send,
    B::Error: Into<BoxError>,
{
    let browser = (config.html.as_ref()).and_then(|render| {
        Some((
            render.clone(),
            ForBrowser::of(request.headers(), request.uri())?,
        ))
    });
    let decision = decide(config, request, span).await;
    match (decision, browser) {
        (Decision::Respond(response), Some((render, browser))) => Decision::Respond(
            browser.render(&*render, response, |page| ResponseBody::full(page, None)),
        ),
        (decision, _) => decision,
    }
}

async fn decide<B, R>(
    config: Arc<Config>,
    request: Request<B>,
    span: tracing::Span,
) -> Decision<B, R>
where
    B: Body + Send,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    #[cfg(feature = "axum")]
    if config.key.uses_path_params() {
        crate::key::collect_path_params(&mut parts);
    }
    // A key that does not come from the body is checked before the body is read: a keyless
    // request is refused at once, not after a slow upload.
    let early_key = if config.key.needs_body() {
        None
    } else {
        match config.key.extract(&parts, &Bytes::new()) {
            Ok(Some(key)) => Some(key),
            Ok(None) if config.key_required => {
                return reject(
                    &config,
                    &span,
                    Rejection::MissingKey {
                        source: config.key.describe(),
                    },
                );
            }
            Ok(None) => return unprotected(&span, parts, RequestBody::new(body)),
            Err(rejection) => return reject(&config, &span, rejection),
        }
    };
    // Before the body is read, under a Tokio timer (a keyless request passed through above
    // needs no runtime).
    // (A task's poll knows without touching the runtime's shared handle.)
    if tokio::task::try_id().is_none() && tokio::runtime::Handle::try_current().is_err() {
        tracing::error!("tower-idempotency needs a Tokio runtime: the request is refused");
        return reject(
            &config,
            &span,
            Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            },
        );
    }
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > config.body_limit as u64) {
        return reject(
            &config,
            &span,
            Rejection::BodyTooLarge {
                limit: config.body_limit,
            },
        );
    }
    let read = match read_request(body, config.body_limit, config.read_timeout).await {
        Ok(read) => read,
        Err(rejection) => return reject(&config, &span, rejection),
    };
    let key = match early_key {
        Some(key) => key,
        None => match config.key.extract(&parts, &read.data) {
            Ok(Some(key)) => key,
            Ok(None) if config.key_required => {
                return reject(
                    &config,
                    &span,
                    Rejection::MissingKey {
                        source: config.key.describe(),
                    },
                );
            }
            Ok(None) => return unprotected(&span, parts, RequestBody::buffered(read)),
            // An empty body holds no key, whatever its type (and an empty JSON body does not
            // parse): with keys optional, that is a request without one. (A body of another
            // type may hold one: still 415.)
            Err(Rejection::UnsupportedMediaType { .. } | Rejection::MalformedBody { .. })
                if !config.key_required && read.data.is_empty() =>
            {
                return unprotected(&span, parts, RequestBody::buffered(read));
            }
            Err(rejection) => return reject(&config, &span, rejection),
        },
    };
    let principal = match &config.principal {
        None => None,
        Some(source) => match source.principal(&parts) {
            Some(who) => Some(who),
            None => {
                tracing::error!(
                    source = %source.describe(),
                    "idempotency: no principal for this request; is the layer before the authentication layer?"
                );
                return reject(
                    &config,
                    &span,
                    Rejection::PrincipalMissing {
                        source: source.describe(),
                    },
                );
            }
        },
    };
    let fingerprint = match identify(
        config.keys.fingerprinter(),
        &config.identity,
        &parts,
        &config.fingerprint_headers,
        &read.data,
        read.trailers.as_ref(),
    ) {
        Ok(fingerprint) => fingerprint,
        Err(rejection) => return reject(&config, &span, rejection),
    };
    // A per-request key is its record; a thing's key has a record per request identity (and a
    // lock of its own, taken below).
    let naming = match config.kind {
        KeyKind::Thing => Naming::Record(&fingerprint),
        _ => Naming::Key,
    };
    let derived = derive(
        &config.keys,
        &parts,
        principal.as_deref(),
        &key,
        naming,
        config.seal,
    );
    let name = derived.name;
    // A short prefix of the keyed hash: enough to tell requests apart in traces, never the key.
    span.record("key", &name[..12]);
    // A layer further out runs this request under this very name (the same layer on the router
    // and on a nested router): it is protected there. Another name is another key: protected
    // here too.
    if IdempotencyContext::holds(&parts.extensions, &name) {
        span.record("reason", "enclosing-layer");
        return unprotected(&span, parts, RequestBody::buffered(read));
    }
    let once = match config.store.client().once(&name) {
        Ok(once) => once,
        Err(e) => unreachable!("a hex name is a valid lock name: {e}"),
    };
    let once = once
        .retention(config.retention)
        .expect("the retention was checked when the layer was built");
    // The fingerprint is the tag a duplicate compares (made again only on the rare wait). Owned
    // by its `Bytes`: the store's copies of it share it, with no allocation each.
    let tag = || Bytes::from_owner(fingerprint);
    let started = Instant::now();
    // A record this instance completed is replayed from its memory (a store with a replay
    // cache), without a round trip.
    let cached = (config.store.cache()).and_then(|cache| cache.get(&name));
    let from_cache = cached.is_some();
    let mut began = match cached {
        Some(record) => Ok(Begin::Done(distlock::once::Record::one_part(record))),
        None => once.begin(tag()).await,
    };
    // Waiting duplicates follow a streamed record live; the others wait for an outcome only
    // briefly: the first request may have answered and be storing it (for a streamed body,
    // its client may have the last byte while the last part and the completion are on their
    // way: wait through the parts for the end).
    let (wait, follow) = match config.on_conflict {
        OnConflict::Wait(wait) => (wait, true),
        _ => (config.completion_grace, false),
    };
    // A store that just said the key is in flight is up, and the handler is running
    // elsewhere: an error while waiting for it is no reason to run it here (fail-open is for
    // a store that cannot be reached at all).
    let mut seen_in_flight = false;
    if let Ok(Begin::InFlight { tag: theirs, .. }) = &began
        && theirs[..] == fingerprint[..]
        && !wait.is_zero()
    {
        seen_in_flight = true;
        // Boxed: waiting is the rare path; it should not grow every request's future.
        began = if follow {
            Box::pin(once.begin_wait(tag(), wait)).await
        } else {
            Box::pin(once.begin_wait_done(tag(), wait)).await
        };
    }
    // (A replay from the replay cache asked the store nothing: no store latency.)
    if !from_cache {
        let took = started.elapsed();
        store_latency("begin", took);
        span.record(
            "store_us",
            i64::try_from(took.as_micros()).unwrap_or(i64::MAX),
        );
    }
    match began {
        Ok(Begin::Acquired(guard)) => {
            // A rotation under way: what the previous secrets' names hold.
            let previous = if config.previous.is_empty() {
                Vec::new()
            } else {
                match Box::pin(take_previous(
                    &config,
                    &parts,
                    principal.as_deref(),
                    &key,
                    &read,
                ))
                .await
                {
                    Previously::Held(held) => held,
                    Previously::Refused(rejection) => {
                        if let Err(error) = guard.abort().await {
                            tracing::debug!(%error, "idempotency: release failed; the lease will expire");
                        }
                        return reject(&config, &span, rejection);
                    }
                    Previously::Done(found) => {
                        if let Err(error) = guard.abort().await {
                            tracing::debug!(%error, "idempotency: release failed; the lease will expire");
                        }
                        let stored = Stored {
                            once: &found.once,
                            key: found.record_key.as_ref(),
                            name: &found.name,
                            fingerprint: &found.fingerprint,
                            request: &parts,
                        };
                        let (response, outcome) =
                            Box::pin(replay(&config, stored, found.record)).await;
                        answered(&span, &response, "replayed");
                        count(outcome);
                        return Decision::Respond(response);
                    }
                }
            };
            let wait = match config.on_conflict {
                OnConflict::Wait(wait) => wait,
                _ => config.completion_grace,
            };
            let thing = match config.kind {
                KeyKind::Thing => {
                    match take_thing(
                        &config,
                        &config.keys,
                        &parts,
                        principal.as_deref(),
                        &key,
                        wait,
                    )
                    .await
                    {
                        Ok(thing) => Some(thing),
                        Err(rejection) => {
                            // Not run: the request's own lease goes at once.
                            if let Err(error) = guard.abort().await {
                                tracing::debug!(%error, "idempotency: release failed; the lease will expire");
                            }
                            return reject(&config, &span, rejection);
                        }
                    }
                }
                _ => None,
            };
            // Same-transaction mode: the handler's writes go in a transaction that holds the
            // key's row, and commit with its outcome.
            #[cfg(feature = "postgres")]
            let transaction = if config.same_transaction {
                match guard.transaction().await {
                    Ok(transaction) => {
                        parts
                            .extensions
                            .insert(crate::Transaction::new(transaction.clone()));
                        Some(transaction)
                    }
                    Err(error) => {
                        tracing::warn!(key = %name, %error, "idempotency: no transaction for the handler: 503, handler not run");
                        drop(thing);
                        if let Err(error) = guard.abort().await {
                            tracing::debug!(%error, "idempotency: release failed; the lease will expire");
                        }
                        return reject(
                            &config,
                            &span,
                            Rejection::StoreUnavailable {
                                retry_after: config.retry_after,
                            },
                        );
                    }
                }
            } else {
                None
            };
            // The handler's lease and fence: the thing's, for a key that names one (greater
            // than that of every earlier execution about it).
            let lease = match &thing {
                Some(thing) => thing.lease(),
                None => guard.guard().lease(),
            };
            tracing::debug!(key = %name, fence = lease.fence(), "idempotency: running the handler");
            span.record("decision", "executed");
            let decision = DecisionCell::new();
            let negotiated = negotiation(&parts.headers);
            // One copy of the name, for the handler's context and for layers further in.
            let name: Arc<str> = name.into();
            IdempotencyContext::protect(&mut parts.extensions, name, lease, decision.clone());
            Decision::Run {
                request: Request::from_parts(parts, RequestBody::buffered(read)),
                run: Some(Box::new(Run {
                    guard,
                    thing,
                    previous,
                    #[cfg(feature = "postgres")]
                    transaction,
                    fingerprint,
                    record_key: derived.record_key,
                    config,
                    decision,
                    negotiated,
                    span,
                })),
            }
        }
        Ok(Begin::Done(record)) => {
            let stored = Stored {
                once: &once,
                key: derived.record_key.as_ref(),
                name: &name,
                fingerprint: &fingerprint,
                request: &parts,
            };
            let (response, outcome) = Box::pin(replay(&config, stored, record)).await;
            answered(&span, &response, "replayed");
            tracing::debug!(key = %name, outcome = outcome.as_str(), "idempotency: stored outcome");
            count(outcome);
            Decision::Respond(response)
        }
        Ok(Begin::InFlight {
            tag: theirs,
            fence,
            parts: appended,
            ..
        }) if theirs[..] == fingerprint[..]
            && appended > 0
            && matches!(config.on_conflict, OnConflict::Wait(_)) =>
        {
            // The first execution is streaming its response: follow it live.
            let stored = Stored {
                once: &once,
                key: derived.record_key.as_ref(),
                name: &name,
                fingerprint: &fingerprint,
                request: &parts,
            };
            let (response, outcome) = Box::pin(join(&config, stored, fence)).await;
            answered(&span, &response, "joined");
            tracing::debug!(key = %name, outcome = outcome.as_str(), "idempotency: joined a response being stored");
            count(outcome);
            Decision::Respond(response)
        }
        Ok(Begin::InFlight {
            tag: theirs,
            retry_after,
            ..
        }) => {
            if theirs[..] == fingerprint[..] {
                reject(
                    &config,
                    &span,
                    Rejection::Conflict {
                        retry_after: config.conflict_retry_after(retry_after),
                    },
                )
            } else {
                reject(&config, &span, Rejection::KeyReused)
            }
        }
        Ok(other) => {
            tracing::error!(?other, "idempotency: unknown store answer");
            reject(
                &config,
                &span,
                Rejection::StoreUnavailable {
                    retry_after: config.retry_after,
                },
            )
        }
        // The store answered, with a record it holds broken: reported, never run again (not
        // even fail-open, which is for a store that does not answer).
        Err(LockError::BrokenRecord { detail, .. }) => {
            tracing::error!(key = %name, %detail, "stored idempotency record is unreadable; not running the handler again");
            reject(
                &config,
                &span,
                Rejection::RecordUnreadable { reason: detail },
            )
        }
        Err(error @ LockError::Capacity { .. }) => {
            tracing::warn!(key = %name, %error, "idempotency store full: 503, handler not run");
            reject(
                &config,
                &span,
                Rejection::StoreFull {
                    retry_after: config.retry_after,
                },
            )
        }
        Err(
            error @ (LockError::Unavailable { .. }
            | LockError::NoQuorum { .. }
            | LockError::NotReplicated { .. }),
        ) if config.fail_open && !seen_in_flight => {
            tracing::warn!(key = %name, %error, "idempotency store unavailable: running the handler UNPROTECTED (fail-open)");
            span.record("decision", "passed-through");
            span.record("reason", "fail-open");
            count(Event::FailOpen);
            IdempotencyContext::unprotect(&mut parts.extensions, name);
            Decision::Run {
                request: Request::from_parts(parts, RequestBody::buffered(read)),
                run: None,
            }
        }
        Err(error) => {
            tracing::warn!(key = %name, %error, "idempotency store unavailable: 503, handler not run");
            reject(
                &config,
                &span,
                Rejection::StoreUnavailable {
                    retry_after: config.retry_after,
                },
            )
        }
    }
}

/// Takes the lock of the thing a key names, so that requests about it run one at a time: a
/// different request about the thing waits as an identical one would (the completion grace, or
/// [`OnConflict::Wait`]), then gets 409.
async fn take_thing(
    config: &Config,
    keys: &Keys,
    parts: &Parts,
    principal: Option<&str>,
    key: &str,
    wait: Duration,
) -> Result<LockGuard, Rejection> {
    let name = derive(keys, parts, principal, key, Naming::Thing, false).name;
    let lock = match config.things.lock(&name) {
        Ok(lock) => lock,
        Err(e) => unreachable!("a hex name is a valid lock name: {e}"),
    };
    let started = Instant::now();
    let taken = if wait.is_zero() {
        lock.try_acquire().await
    } else {
        Box::pin(lock.acquire(wait)).await
    };
    store_latency("thing", started.elapsed());
    match taken {
        Ok(guard) => Ok(guard),
        Err(LockError::Held { retry_after, .. }) => Err(Rejection::Conflict {
            retry_after: config.conflict_retry_after(retry_after),
        }),
        Err(LockError::WaitTimeout { .. }) => Err(Rejection::Conflict {
            retry_after: config.retry_after,
        }),
        Err(error @ LockError::Capacity { .. }) => {
            tracing::warn!(%error, "idempotency store full: 503, handler not run");
            Err(Rejection::StoreFull {
                retry_after: config.retry_after,
            })
        }
        Err(error) => {
            tracing::warn!(%error, "idempotency store unavailable: 503, handler not run");
            Err(Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            })
        }
    }
}

/// A record made under a previous secret, found while a rotation is under way.
struct Found {
    once: distlock::Once,
    record_key: Option<[u8; 32]>,
    name: String,
    fingerprint: [u8; 32],
    record: distlock::once::Record,
}

/// What the names the previous secrets derive hold for a request.
enum Previously {
    /// Nothing: their leases, held while the request runs.
    Held(Vec<Held>),
    /// A record: replayed.
    Done(Box<Found>),
    /// A lease held by another request, or a store error.
    Refused(Rejection),
}

/// While a rotation is under way, takes the leases of the names each previous secret derives
/// for this request (after the current one's, and without waiting: an instance whose current
/// secret is a previous one here takes them in the other order, and one of the two gets 409
/// instead of both waiting), or finds the record made under one of them.
async fn take_previous(
    config: &Config,
    parts: &Parts,
    principal: Option<&str>,
    key: &str,
    read: &crate::body::Read,
) -> Previously {
    let mut held = Vec::new();
    for keys in &config.previous {
        let fingerprint = match identify(
            keys.fingerprinter(),
            &config.identity,
            parts,
            &config.fingerprint_headers,
            &read.data,
            read.trailers.as_ref(),
        ) {
            Ok(fingerprint) => fingerprint,
            Err(rejection) => return Previously::Refused(rejection),
        };
        let naming = match config.kind {
            KeyKind::Thing => Naming::Record(&fingerprint),
            _ => Naming::Key,
        };
        let derived = derive(keys, parts, principal, key, naming, config.seal);
        let once = match config.store.client().once(&derived.name) {
            Ok(once) => once,
            Err(e) => unreachable!("a hex name is a valid lock name: {e}"),
        };
        let once = once
            .retention(config.retention)
            .expect("the retention was checked when the layer was built");
        match once.begin(Bytes::copy_from_slice(&fingerprint)).await {
            Ok(Begin::Acquired(guard)) => held.push(Held::Record(guard)),
            Ok(Begin::Done(record)) => {
                return Previously::Done(Box::new(Found {
                    once,
                    record_key: derived.record_key,
                    name: derived.name,
                    fingerprint,
                    record,
                }));
            }
            Ok(Begin::InFlight {
                tag, retry_after, ..
            }) => {
                return Previously::Refused(
                    if tag[..] != fingerprint[..] && config.kind == KeyKind::Request {
                        Rejection::KeyReused
                    } else {
                        Rejection::Conflict {
                            retry_after: config.conflict_retry_after(retry_after),
                        }
                    },
                );
            }
            Ok(_) => {
                return Previously::Refused(Rejection::StoreUnavailable {
                    retry_after: config.retry_after,
                });
            }
            Err(LockError::BrokenRecord { detail, .. }) => {
                return Previously::Refused(Rejection::RecordUnreadable { reason: detail });
            }
            Err(LockError::Capacity { .. }) => {
                return Previously::Refused(Rejection::StoreFull {
                    retry_after: config.retry_after,
                });
            }
            Err(error) => {
                tracing::warn!(%error, "idempotency store unavailable: 503, handler not run");
                return Previously::Refused(Rejection::StoreUnavailable {
                    retry_after: config.retry_after,
                });
            }
        }
        if config.kind == KeyKind::Thing {
            match take_thing(config, keys, parts, principal, key, Duration::ZERO).await {
                Ok(thing) => held.push(Held::Thing(thing)),
                Err(rejection) => return Previously::Refused(rejection),
            }
        }
    }
    Previously::Held(held)
}
