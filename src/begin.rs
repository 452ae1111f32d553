//! Before the handler: read the body, find the key and fingerprint, and ask the store, in one
//! round trip, whether to replay, reject or run.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use distlock::{Begin, OnceGuard};
use http::{Request, Response, header};
use http_body::Body;

use crate::body::read_request;
use crate::fingerprint::fingerprint;
use crate::layer::{Config, OnConflict};
use crate::metrics::{Outcome, count, store_latency};
use crate::replay::replay;
use crate::scope::store_name;
use crate::{IdempotencyContext, Rejection};

/// A protected execution: the lease, and what is needed to store its outcome.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) guard: OnceGuard,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) config: Arc<Config>,
    /// The request's span, entered again while the outcome is stored.
    pub(crate) span: tracing::Span,
}

/// What to do with a request.
pub(crate) enum Decision<B> {
    /// Answer without the handler: a rejection or a replay.
    Respond(Response<Bytes>),
    /// Call the handler, under a lease (`Some`) or unprotected (`None`).
    Run {
        request: Request<B>,
        run: Option<Box<Run>>,
    },
}

fn reject<B>(rejection: Rejection) -> Decision<B> {
    tracing::debug!(%rejection, "idempotency: rejected");
    count(match rejection {
        Rejection::Conflict { .. } => Outcome::Conflict,
        Rejection::KeyReused => Outcome::Mismatch,
        Rejection::StoreUnavailable { .. } => Outcome::StoreError,
        _ => Outcome::Rejected,
    });
    Decision::Respond(rejection.to_response())
}

pub(crate) async fn begin<B>(
    config: Arc<Config>,
    request: Request<B>,
    span: tracing::Span,
) -> Decision<B>
where
    B: Body + From<Bytes> + Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > config.body_limit as u64) {
        return reject(Rejection::BodyTooLarge {
            limit: config.body_limit,
        });
    }
    let bytes = match read_request(body, config.body_limit, config.read_timeout).await {
        Ok(bytes) => bytes,
        Err(rejection) => return reject(rejection),
    };
    let key = match config.key.extract(&parts, &bytes) {
        Ok(Some(key)) => key,
        Ok(None) if config.key_required => {
            return reject(Rejection::MissingKey {
                source: config.key.describe(),
            });
        }
        Ok(None) => {
            count(Outcome::Passthrough);
            return Decision::Run {
                request: Request::from_parts(parts, B::from(bytes)),
                run: None,
            };
        }
        Err(rejection) => return reject(rejection),
    };
    let name = store_name(&parts, config.principal.as_deref(), &key);
    let fingerprint = fingerprint(&parts, &config.fingerprint_headers, &bytes);
    let once = match config.store.client().once(&name) {
        Ok(once) => once,
        Err(e) => unreachable!("a hex name is a valid lock name: {e}"),
    };
    let once = once
        .retention(config.retention)
        .expect("the retention was checked when the layer was built");
    let tag = Bytes::copy_from_slice(&fingerprint);
    let started = Instant::now();
    let mut began = once.begin(tag.clone()).await;
    if let (OnConflict::Wait(wait), Ok(Begin::InFlight { tag: theirs, .. })) =
        (config.on_conflict, &began)
        && theirs[..] == fingerprint[..]
    {
        began = once.begin_wait(tag, wait).await;
    }
    store_latency("begin", started.elapsed());
    match began {
        Ok(Begin::Acquired(guard)) => {
            tracing::debug!(key = %name, fence = guard.fence(), "idempotency: running the handler");
            parts
                .extensions
                .insert(IdempotencyContext::protected(name, guard.guard().lease()));
            Decision::Run {
                request: Request::from_parts(parts, B::from(bytes)),
                run: Some(Box::new(Run {
                    guard,
                    fingerprint,
                    config,
                    span,
                })),
            }
        }
        Ok(Begin::Done(stored)) => {
            let (response, outcome) = replay(&config, &stored, &fingerprint);
            tracing::debug!(key = %name, outcome = outcome.as_str(), "idempotency: stored outcome");
            count(outcome);
            Decision::Respond(response)
        }
        Ok(Begin::InFlight { tag: theirs, .. }) => {
            if theirs[..] == fingerprint[..] {
                reject(Rejection::Conflict {
                    retry_after: config.retry_after,
                })
            } else {
                reject(Rejection::KeyReused)
            }
        }
        Ok(other) => {
            tracing::error!(?other, "idempotency: unknown store answer");
            reject(Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            })
        }
        Err(error) if config.fail_open => {
            tracing::warn!(key = %name, %error, "idempotency store unavailable: running the handler UNPROTECTED (fail-open)");
            count(Outcome::FailOpen);
            parts
                .extensions
                .insert(IdempotencyContext::unprotected(name));
            Decision::Run {
                request: Request::from_parts(parts, B::from(bytes)),
                run: None,
            }
        }
        Err(error) => {
            tracing::warn!(key = %name, %error, "idempotency store unavailable: 503, handler not run");
            reject(Rejection::StoreUnavailable {
                retry_after: config.retry_after,
            })
        }
    }
}
