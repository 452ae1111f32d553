//! A protected execution's state, shared by the steps it goes through: the lease (and a
//! thing's lock) taken by `begin`, what `execution` and `tee` need to run and feed it, what
//! `complete` needs to store its outcome; and how it ended, as the response future learns it.

use std::any::Any;
use std::sync::Arc;

use distlock::{LockGuard, OnceGuard};
use http::{HeaderMap, HeaderName, Response, StatusCode, header};

use crate::body::ResponseBody;
use crate::layer::Config;
use crate::outcome::DecisionCell;
use crate::record::{EncodeHead, Kind, Sealer};

/// A protected execution: the lease, and what is needed to store its outcome.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) guard: OnceGuard,
    /// For a key that names a thing, the thing's lock: held until this is dropped, after the
    /// outcome of the record is stored (or released).
    pub(crate) thing: Option<LockGuard>,
    /// While previous secrets are configured, the leases taken under the names they derive
    /// (so that an instance whose current secret is one of them is kept out): released when
    /// this is dropped, nothing stored under them.
    #[expect(dead_code, reason = "held for their drop, which releases them")]
    pub(crate) previous: Vec<Held>,
    /// (Same-transaction mode) The handler's transaction, kept open until the outcome is
    /// stored in it and committed (or it is rolled back): the handler may have let go of its
    /// own handle.
    #[cfg(feature = "postgres")]
    #[expect(
        dead_code,
        reason = "held so that the transaction lives until the completion"
    )]
    pub(crate) transaction: Option<distlock::postgres::Transaction>,
    pub(crate) fingerprint: [u8; 32],
    /// The AES-256-GCM key of the record (derived from the raw key, its scope and the secret);
    /// `None` on the in-memory store, which keeps records in clear (see `record::seal`).
    pub(crate) record_key: Option<[u8; 32]>,
    pub(crate) config: Arc<Config>,
    /// The handler's decision through its context, if it made one.
    pub(crate) decision: Arc<DecisionCell>,
    /// The request's values of the headers a response may vary on (see `complete`).
    pub(crate) negotiated: http::HeaderMap,
    /// The request's span, entered again while the outcome is stored.
    pub(crate) span: tracing::Span,
}

/// A lease held for the run's duration only (dropping it releases it).
#[derive(Debug)]
#[expect(dead_code, reason = "held for their drop, which releases them")]
pub(crate) enum Held {
    Record(OnceGuard),
    Thing(LockGuard),
}

impl Run {
    /// The cipher of this execution's record.
    pub(crate) fn sealer(&self) -> Sealer<'_> {
        Sealer::of(self.record_key.as_ref(), self.guard.guard().name())
    }

    /// The head of this execution's record for a response (`vary`: see [`negotiated`]). A
    /// `streamed` head keeps the announced length too, whatever the policy: a duplicate joining
    /// the body as it is written announces it (a replay of a complete record sets it from what
    /// it replays, so a whole record does not store it).
    pub(crate) fn head<'a>(
        &'a self,
        kind: Kind,
        status: StatusCode,
        (headers, streamed): (&'a HeaderMap, bool),
        vary: &'a HeaderMap,
    ) -> EncodeHead<'a, impl Fn(&HeaderName) -> bool + 'a> {
        EncodeHead {
            kind,
            fingerprint: &self.fingerprint,
            status,
            fence: self.guard.fence(),
            headers,
            keep: move |name: &HeaderName| {
                (streamed && name == header::CONTENT_LENGTH)
                    || self.config.replay_headers.keeps(name)
            },
            vary,
        }
    }

    /// A record in one part saying that this execution's outcome is unknown.
    pub(crate) fn unknown_whole(&self) -> Vec<u8> {
        let none = HeaderMap::new();
        self.sealer().seal_whole(
            &self.head(
                Kind::Unknown,
                StatusCode::INTERNAL_SERVER_ERROR,
                (&none, false),
                &none,
            ),
            &[],
            None,
        )
    }
}

/// How a protected execution ended, as the response future learns it.
// Moved once, through a oneshot channel that has room for it: boxing the response would only
// add an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Finished<B, E> {
    /// The response head, with a body that is whole or fed by the execution.
    Response(Response<ResponseBody<B>>),
    /// The service returned an error (its outcome is handled as unknown).
    Error(E),
    /// The handler panicked: the panic resumes in the response future, as without the layer.
    Panic(Box<dyn Any + Send>),
}
