//! The lock and its run-once records in a PostgreSQL table (feature `postgres`), through a
//! `deadpool-postgres` pool of `tokio-postgres` connections.
//!
//! One row per name: the holder's token and lease (by the database's clock), the fencing
//! counter, the holder's tag and since when it holds, the completed record and when it
//! expires. Every operation is one statement (the acquisition, an append and a completion one
//! function call each), in its own transaction, on a connection taken from the pool for its
//! duration only: a waiting request holds no connection between its looks.
//!
//! A guard can also [bind a transaction](crate::OnceGuard::transaction): a connection of the
//! pool with a transaction open, that holds the name's row locked (`FOR UPDATE`) until it ends.
//! The work does its writes in it, and the completion stores the record in it and commits:
//! either both commit, or neither does. While it is open the row lock keeps everyone else out
//! (their acquisitions skip the locked row and report it held, never wait on it), so the lease
//! is renewed in it and nowhere else; when the process dies, the database ends the transaction
//! and the lock with its connection, and the lease (by then past) lets the next holder in.
//! Appends go through it too (an append on another connection would wait for the row), so
//! the parts commit with the record: a reader elsewhere sees the record being written, with no
//! parts, until the commit.
//!
//! | column | holds |
//! |---|---|
//! | `name` | the lock key (`prefix:{name}`) |
//! | `token`, `lease_until` | the holder's token and lease, `NULL` when nobody holds |
//! | `fence` | the fencing counter (a new one starts from the caller's clock in microseconds) |
//! | `tag`, `since` | the holder's tag and since when it holds |
//! | `record`, `completed_by` | the completed one-part record and the token that stored it (also of a streamed one) |
//! | `expires_at` | when the state (record, counter, parts) expires: `NULL` for never |
//! | `stored` | how many parts the parts table holds for the name (0 for none) |
//! | `streamed` | the part count of a completed streamed record (`NULL` for none) |
//!
//! ## Streamed records
//!
//! The parts of a streamed record are rows of `{table}_parts` (`name`, `idx` from 0, `part`;
//! primary key `(name, idx)`), which reference the name's row with `ON DELETE CASCADE`: a
//! purge or the sweep takes them along. The statements follow the Redis scripts:
//!
//! * An append (a function) locks the row, and stores the part at `idx` only if the live
//!   lease is the caller's and `stored` equals `idx`; the same part at the last index is a
//!   retry of an append whose answer was lost (acknowledged, not stored twice); anything else
//!   is a mismatch (`-1 - stored`). It keeps the state for the retention.
//! * A completion after `n` appends (a function) needs `stored = n`, adds the last part and
//!   sets `streamed`; one that replaces the parts deletes them and stores a one-part record.
//!   A release without a record deletes the parts with the lock.
//! * The acquisition reports the parts appended so far to a contender, the first part and the
//!   count of a streamed record, and deletes the parts only when it takes a name whose
//!   `stored` says a writer left some (an abandoned or expired one): nothing more on the
//!   common path. An expired state's parts are no record.
//! * A read of the parts is one statement (one snapshot): the state, the fence, the counts,
//!   the lease left and the parts asked for. Readers in this process are woken by the
//!   appends and the completion; readers elsewhere poll with backoff (nothing is announced
//!   across processes).
//!
//! Expired rows are deleted by a sweep every minute, at most 1,000 at a time, and ignored
//! until then. `prepare` makes the tables and functions if missing, and brings a table made by
//! an earlier version up to date (the part counts and the parts table).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Object, Pool};

use super::waiters::Waiters;
use super::{
    Appended, Attempt, Backend, BoxFuture, Mode, Op, REPLACE_PARTS, counter_start, millis,
};
use crate::once::{Holder, Inspection, Parts, Purged, Record, RecordState};
use crate::{ConfigError, LockError, LockName, StoreWarning, Token};

/// The largest record stored (a `bytea` holds up to 1 GB; a record is also held in memory).
const MAX_RECORD: usize = 256 << 20;

/// How often expired rows are swept, and how many at most at a time.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
const SWEEP_BATCH: i64 = 1000;

/// A transaction bound to a lease: see [`OnceGuard::transaction`](crate::OnceGuard::transaction).
/// Run the work's statements on [`client`](Self::client); the guard's completion stores the
/// record in it and commits, its release (or a drop without either) rolls it back.
#[derive(Clone)]
pub struct Transaction {
    inner: Arc<Bound>,
}

impl std::fmt::Debug for Transaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Transaction {
    /// The connection the transaction is open on: run the work's statements here, and they
    /// commit with the record (or not at all).
    pub fn client(&self) -> &tokio_postgres::Client {
        self.inner.conn()
    }
}

impl std::ops::Deref for Transaction {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        self.client()
    }
}

struct Bound {
    name: String,
    /// `None` once committed or rolled back and handed back to the pool... or detached.
    conn: Option<Object>,
    /// Whether the transaction ended (committed or rolled back).
    ended: std::sync::atomic::AtomicBool,
}

impl Bound {
    fn conn(&self) -> &tokio_postgres::Client {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a bound transaction keeps its connection until dropped"),
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        // Never back to the pool with a transaction open: closed, so the database rolls it
        // back and lets the row go.
        if !self.ended.load(std::sync::atomic::Ordering::Acquire)
            && let Some(conn) = self.conn.take()
        {
            drop(Object::take(conn));
        }
    }
}

/// The store in a table of a PostgreSQL database.
pub(crate) struct PostgresBackend {
    pool: Pool,
    table: String,
    waiters: Arc<Waiters>,
    /// The transactions bound to leases, by owner token.
    bound: Mutex<Vec<(Token, Weak<Bound>)>>,
    sql: Sql,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// The statements, with the table's name in them.
struct Sql {
    schema: String,
    acquire: String,
    extend: String,
    release: String,
    complete: String,
    complete_whole: String,
    append: String,
    parts: String,
    stored_parts: String,
    locked: String,
    lock_row: String,
    inspect: String,
    purge: String,
    exists: String,
    scan: String,
    sweep: String,
}

impl Sql {
    fn new(table: &str) -> Self {
        // In the table's schema, named after it.
        let function = format!("{table}_acquire");
        let append = format!("{table}_append");
        let complete = format!("{table}_complete");
        let parts = format!("{table}_parts");
        let index = format!("{}_expires_at", table.rsplit('.').next().unwrap_or(table));
        let ms = "* interval '1 millisecond'";
        Sql {
            schema: format!(
                r#"
CREATE TABLE IF NOT EXISTS {table} (
    name text PRIMARY KEY,
    token text,
    lease_until timestamptz,
    fence bigint,
    tag bytea,
    since timestamptz,
    record bytea,
    completed_by text,
    expires_at timestamptz,
    stored bigint NOT NULL DEFAULT 0,
    streamed bigint
);
-- A table made by an earlier version gains the part counts. Only when missing: ALTER TABLE
-- takes the table's strongest lock even when there is nothing to add, and would wait behind
-- every transaction bound to a lease.
DO $do$
BEGIN
    IF (SELECT count(*) FROM pg_attribute WHERE attrelid = '{table}'::regclass
        AND attname IN ('stored', 'streamed') AND NOT attisdropped) < 2 THEN
        ALTER TABLE {table} ADD COLUMN IF NOT EXISTS stored bigint NOT NULL DEFAULT 0,
            ADD COLUMN IF NOT EXISTS streamed bigint;
    END IF;
END
$do$;
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
CREATE TABLE IF NOT EXISTS {parts} (
    name text NOT NULL REFERENCES {table} (name) ON DELETE CASCADE,
    idx bigint NOT NULL,
    part bytea NOT NULL,
    PRIMARY KEY (name, idx)
);
-- The acquisition of an earlier version answers without the part count: replaced (a function's
-- result type cannot be changed in place).
DO $do$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_proc
        WHERE oid = to_regprocedure('{function}(text, text, bigint, bigint, boolean, bytea, bigint)')
        AND NOT ('n_parts' = ANY (proargnames))) THEN
        DROP FUNCTION {function}(text, text, bigint, bigint, boolean, bytea, bigint);
    END IF;
END
$do$;
CREATE OR REPLACE FUNCTION {function}(
    p_name text, p_token text, p_lease_ms bigint, p_state_ms bigint, p_once boolean,
    p_tag bytea, p_start bigint)
RETURNS TABLE(kind int, fence bigint, ttl_ms bigint, holder_tag bytea, rec bytea, n_parts bigint)
LANGUAGE plpgsql AS $$
DECLARE
    r {table}%ROWTYPE;
    now_ts timestamptz := clock_timestamp();
    state_until timestamptz := CASE WHEN p_state_ms > 0 THEN now_ts + p_state_ms {ms} END;
BEGIN
    LOOP
        SELECT * INTO r FROM {table} t WHERE t.name = p_name FOR UPDATE SKIP LOCKED;
        EXIT WHEN FOUND;
        SELECT * INTO r FROM {table} t WHERE t.name = p_name;
        IF NOT FOUND THEN
            -- Inserted only where no row is seen: an insertion that meets a row version a
            -- bound transaction made (as its appends make) would wait for it to end.
            INSERT INTO {table} (name, token, lease_until, fence, tag, since, expires_at)
            VALUES (p_name, p_token, now_ts + p_lease_ms {ms}, p_start + 1, p_tag, now_ts,
                state_until)
            ON CONFLICT (name) DO NOTHING;
            IF FOUND THEN
                RETURN QUERY SELECT 1, p_start + 1, NULL::bigint, NULL::bytea, NULL::bytea,
                    0::bigint;
                RETURN;
            END IF;
            -- Inserted by another acquisition meanwhile: looked at again.
            CONTINUE;
        END IF;
        -- Another transaction has the row.
        IF r.token IS NOT NULL THEN
            -- Held: never wait on a row a bound transaction holds (for the whole work, its
            -- renewals unseen until it ends).
            RETURN QUERY SELECT 0, r.fence,
                GREATEST(0, (EXTRACT(EPOCH FROM (r.lease_until - now_ts)) * 1000)::bigint),
                r.tag, NULL::bytea, r.stored;
            RETURN;
        END IF;
        IF p_once AND (r.expires_at IS NULL OR r.expires_at > now_ts) THEN
            -- A record (another acquisition reads it): it is the answer.
            IF r.record IS NOT NULL THEN
                RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea, r.record, 1::bigint;
                RETURN;
            END IF;
            IF r.streamed IS NOT NULL THEN
                RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea,
                    (SELECT p.part FROM {parts} p WHERE p.name = p_name AND p.idx = 0),
                    r.streamed;
                RETURN;
            END IF;
        END IF;
        -- Nobody holds it, and a statement has it for a moment (an acquisition, a purge):
        -- waited for, not reported held (with no holder to name).
        SELECT * INTO r FROM {table} t WHERE t.name = p_name FOR UPDATE;
        EXIT WHEN FOUND;
    END LOOP;
    IF r.token IS NOT NULL AND r.lease_until > now_ts THEN
        IF r.token = p_token THEN
            -- The same attempt sent again: taken, with the fence it drew.
            RETURN QUERY SELECT 1, r.fence, NULL::bigint, NULL::bytea, NULL::bytea, 0::bigint;
        ELSE
            -- Held, with the parts appended so far (a duplicate may follow them).
            RETURN QUERY SELECT 0, r.fence,
                GREATEST(0, (EXTRACT(EPOCH FROM (r.lease_until - now_ts)) * 1000)::bigint),
                r.tag, NULL::bytea, r.stored;
        END IF;
        RETURN;
    END IF;
    IF r.expires_at IS NOT NULL AND r.expires_at <= now_ts THEN
        -- The state expired: a new counter starts from the caller's clock, and its parts are
        -- no record.
        r.fence := NULL;
        r.record := NULL;
        r.streamed := NULL;
    END IF;
    IF p_once AND r.record IS NOT NULL THEN
        RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea, r.record, 1::bigint;
        RETURN;
    END IF;
    IF p_once AND r.streamed IS NOT NULL THEN
        RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea,
            (SELECT p.part FROM {parts} p WHERE p.name = p_name AND p.idx = 0), r.streamed;
        RETURN;
    END IF;
    IF r.stored > 0 THEN
        -- A new writer starts from no parts (only when a writer died mid-stream, or a streamed
        -- record expired).
        DELETE FROM {parts} p WHERE p.name = p_name;
    END IF;
    UPDATE {table} t SET token = p_token, lease_until = now_ts + p_lease_ms {ms},
        fence = COALESCE(r.fence, p_start) + 1, tag = p_tag, since = now_ts, record = NULL,
        completed_by = NULL, expires_at = state_until, stored = 0, streamed = NULL
    WHERE t.name = p_name;
    RETURN QUERY SELECT 1, COALESCE(r.fence, p_start) + 1, NULL::bigint, NULL::bytea, NULL::bytea,
        0::bigint;
END
$$;
-- Appends part p_index, if the live lease is p_token's. 1: stored (now, or by an earlier call
-- whose answer was lost: the same part is the last one); 0: not the holder's (nothing
-- appended); -1 - n: n parts are stored, and not this one at p_index (nothing appended).
CREATE OR REPLACE FUNCTION {append}(
    p_name text, p_token text, p_index bigint, p_part bytea, p_state_ms bigint)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    now_ts timestamptz := clock_timestamp();
    state_until timestamptz := CASE WHEN p_state_ms > 0 THEN now_ts + p_state_ms {ms} END;
BEGIN
    SELECT t.token, t.lease_until, t.stored INTO r FROM {table} t WHERE t.name = p_name
    FOR UPDATE;
    IF NOT FOUND OR r.token IS DISTINCT FROM p_token OR r.lease_until IS NULL
        OR r.lease_until <= now_ts THEN
        RETURN 0;
    END IF;
    IF r.stored = p_index THEN
        INSERT INTO {parts} (name, idx, part) VALUES (p_name, p_index, p_part);
    ELSIF NOT (r.stored = p_index + 1 AND EXISTS (SELECT 1 FROM {parts} p
            WHERE p.name = p_name AND p.idx = p_index AND p.part = p_part)) THEN
        RETURN -1 - r.stored;
    END IF;
    -- Every part lives as long as the record would.
    UPDATE {table} t SET stored = GREATEST(r.stored, p_index + 1), expires_at = state_until
    WHERE t.name = p_name;
    RETURN 1;
END
$$;
-- Stores the record and releases, if p_token holds the name. p_appended: 0 for a one-part
-- record, n > 0 for the last part of a streamed record after n parts (which must be stored),
-- -1 for a one-part record replacing the parts stored. 1: stored (now, or by an earlier call
-- with this token whose answer was lost); 0: not the holder's; -1 - n: n parts are stored
-- instead of p_appended (nothing touched).
CREATE OR REPLACE FUNCTION {complete}(
    p_name text, p_token text, p_record bytea, p_state_ms bigint, p_appended bigint)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    now_ts timestamptz := clock_timestamp();
    state_until timestamptz := CASE WHEN p_state_ms > 0 THEN now_ts + p_state_ms {ms} END;
BEGIN
    SELECT t.token, t.stored, t.completed_by INTO r FROM {table} t WHERE t.name = p_name
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF r.token IS DISTINCT FROM p_token THEN
        IF r.token IS NULL AND r.completed_by = p_token THEN
            -- A completion whose answer was lost, sent again: done; kept for the retention.
            UPDATE {table} t SET expires_at = state_until WHERE t.name = p_name;
            RETURN 1;
        END IF;
        RETURN 0;
    END IF;
    IF p_appended < 0 THEN
        IF r.stored > 0 THEN
            DELETE FROM {parts} p WHERE p.name = p_name;
        END IF;
    ELSIF r.stored <> p_appended THEN
        RETURN -1 - r.stored;
    ELSIF p_appended > 0 THEN
        INSERT INTO {parts} (name, idx, part) VALUES (p_name, p_appended, p_record);
    END IF;
    UPDATE {table} t SET
        record = CASE WHEN p_appended > 0 THEN NULL ELSE p_record END,
        streamed = CASE WHEN p_appended > 0 THEN p_appended + 1 END,
        stored = CASE WHEN p_appended > 0 THEN p_appended + 1 ELSE 0 END,
        completed_by = p_token, token = NULL, lease_until = NULL, tag = NULL,
        expires_at = state_until
    WHERE t.name = p_name;
    RETURN 1;
END
$$;
"#
            ),
            acquire: format!(
                "SELECT kind, fence, ttl_ms, holder_tag, rec, n_parts \
                 FROM {function}($1, $2, $3, $4, $5, $6, $7)"
            ),
            extend: format!(
                "UPDATE {table} SET lease_until = clock_timestamp() + $3::bigint {ms} \
                 WHERE name = $1 AND token = $2 RETURNING 1"
            ),
            // Without a record, what was appended goes with the lock.
            release: format!(
                "WITH released AS (UPDATE {table} SET token = NULL, lease_until = NULL, \
                 tag = NULL, stored = 0 WHERE name = $1 AND token = $2 RETURNING 1), \
                 dropped AS (DELETE FROM {parts} WHERE name = $1 \
                 AND EXISTS (SELECT 1 FROM released)) \
                 SELECT 1 FROM released"
            ),
            complete: format!("SELECT {complete}($1, $2, $3, $4, $5)"),
            // The common case, a one-part record with no parts stored, in a plain statement
            // (every execution completes); anything else goes to the function.
            complete_whole: format!(
                "UPDATE {table} SET record = $3, streamed = NULL, completed_by = $2, \
                 token = NULL, lease_until = NULL, tag = NULL, \
                 expires_at = CASE WHEN $4::bigint > 0 \
                     THEN clock_timestamp() + $4::bigint {ms} END \
                 WHERE name = $1 AND token = $2 AND stored = 0 RETURNING 1"
            ),
            append: format!("SELECT {append}($1, $2, $3, $4, $5)"),
            // One statement, one snapshot: the state and the parts from $2 (before $3) it shows.
            // A row per part; one row with no part when none is shown; none without a row.
            parts: format!(
                "SELECT s.fence, s.claimed, s.held, s.live, s.record_parts, s.stored, s.lease_ms, \
                 s.whole IS NOT NULL, CASE WHEN s.live AND s.whole IS NOT NULL AND $2::bigint = 0 AND $3::bigint > 0 \
                      THEN s.whole END, \
                 p.part \
                 FROM (SELECT t.fence, t.token IS NOT NULL AS claimed, \
                       t.token IS NOT NULL AND t.lease_until > c.now_ts AS held, \
                       (t.expires_at IS NULL OR t.expires_at > c.now_ts) AS live, \
                       t.record AS whole, \
                       CASE WHEN t.record IS NOT NULL THEN 1 ELSE t.streamed END AS record_parts, \
                       t.stored, \
                       (EXTRACT(EPOCH FROM (t.lease_until - c.now_ts)) * 1000)::bigint AS lease_ms \
                       FROM {table} t, (SELECT clock_timestamp() AS now_ts) c \
                       WHERE t.name = $1) s \
                 LEFT JOIN LATERAL (SELECT q.idx, q.part FROM {parts} q \
                       WHERE q.name = $1 AND q.idx >= $2::bigint AND q.idx < $3::bigint \
                       AND s.whole IS NULL \
                       AND ((s.live AND s.record_parts IS NOT NULL) \
                            OR (s.claimed AND NOT (s.live AND s.record_parts IS NOT NULL))) \
                       ) p ON true \
                 ORDER BY p.idx"
            ),
            stored_parts: format!(
                "SELECT part FROM {parts} WHERE name = $1 AND idx >= $2::bigint \
                 AND idx < $3::bigint ORDER BY idx"
            ),
            // Whether a transaction holds the row (skipped: locked).
            locked: format!("SELECT 1 FROM {table} WHERE name = $1 FOR KEY SHARE SKIP LOCKED"),
            lock_row: format!("SELECT 1 FROM {table} WHERE name = $1 AND token = $2 FOR UPDATE"),
            inspect: format!(
                "SELECT token IS NOT NULL AND lease_until > clock_timestamp(), \
                 (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint, \
                 fence, tag, (EXTRACT(EPOCH FROM since) * 1000000)::bigint, \
                 CASE WHEN expires_at IS NULL OR expires_at > clock_timestamp() THEN \
                      COALESCE(record, CASE WHEN streamed IS NOT NULL THEN \
                          COALESCE((SELECT p.part FROM {parts} p WHERE p.name = t.name \
                                    AND p.idx = 0), ''::bytea) END) END, \
                 (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::bigint, \
                 CASE WHEN record IS NOT NULL THEN 1 ELSE streamed END \
                 FROM {table} t WHERE name = $1 \
                 AND (expires_at IS NULL OR expires_at > clock_timestamp() \
                      OR (token IS NOT NULL AND lease_until > clock_timestamp()))"
            ),
            // The parts go with the row (ON DELETE CASCADE).
            purge: format!(
                "DELETE FROM {table} WHERE name IN (SELECT name FROM {table} WHERE name = $1 \
                 AND (token IS NULL OR lease_until <= clock_timestamp()) FOR UPDATE SKIP LOCKED) \
                 RETURNING (expires_at IS NULL OR expires_at > clock_timestamp())"
            ),
            exists: format!(
                "SELECT (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint \
                 FROM {table} WHERE name = $1"
            ),
            scan: format!(
                "SELECT name FROM {table} WHERE name LIKE $1 ESCAPE '\\' \
                 AND (expires_at IS NULL OR expires_at > clock_timestamp() \
                      OR (token IS NOT NULL AND lease_until > clock_timestamp())) ORDER BY name"
            ),
            sweep: format!(
                "DELETE FROM {table} WHERE name IN (SELECT name FROM {table} \
                 WHERE expires_at < clock_timestamp() \
                 AND (token IS NULL OR lease_until < clock_timestamp()) \
                 LIMIT $1::bigint FOR UPDATE SKIP LOCKED)"
            ),
        }
    }
}

/// Checks a table name: an identifier, or `schema.table`, of letters, digits and `_`.
pub(crate) fn check_table(table: &str) -> Result<(), ConfigError> {
    let ok = !table.is_empty()
        && table.len() <= 48
        && table.split('.').count() <= 2
        && table.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field: "table",
            reason: format!(
                "{table:?}: a table name is letters, digits and _ (not first), optionally after \
                 a schema and a dot, at most 48 characters"
            ),
        })
    }
}

fn database_error(name: &str, ambiguous: bool, error: impl Into<DbError>) -> LockError {
    let error = error.into();
    let unreachable = error.unreachable();
    LockError::Database {
        name: name.to_owned(),
        unreachable,
        ambiguous: ambiguous && unreachable,
        source: error.into_boxed(),
    }
}

/// What can fail talking to the database.
pub(crate) enum DbError {
    Pool(deadpool_postgres::PoolError),
    Query(tokio_postgres::Error),
}

impl DbError {
    /// Whether the database could not be reached (as opposed to refusing a statement).
    fn unreachable(&self) -> bool {
        match self {
            DbError::Pool(_) => true,
            DbError::Query(e) => {
                e.is_closed()
                    || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
            }
        }
    }

    fn into_boxed(self) -> Box<dyn std::error::Error + Send + Sync> {
        match self {
            DbError::Pool(e) => Box::new(e),
            DbError::Query(e) => Box::new(e),
        }
    }
}

impl From<deadpool_postgres::PoolError> for DbError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        DbError::Pool(e)
    }
}

impl From<tokio_postgres::Error> for DbError {
    fn from(e: tokio_postgres::Error) -> Self {
        DbError::Query(e)
    }
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl PostgresBackend {
    pub(crate) fn new(pool: Pool, table: &str) -> Result<Arc<Self>, ConfigError> {
        check_table(table)?;
        let backend = Arc::new(PostgresBackend {
            pool,
            table: table.to_owned(),
            waiters: Waiters::local(),
            bound: Mutex::new(Vec::new()),
            sql: Sql::new(table),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep(Arc::downgrade(&backend)));
        }
        Ok(backend)
    }

    /// The transaction bound to `token`'s lease, if any.
    fn bound(&self, token: &Token) -> Option<Arc<Bound>> {
        let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        bound.retain(|(_, weak)| weak.strong_count() > 0);
        bound
            .iter()
            .find(|(t, _)| t == token)
            .and_then(|(_, weak)| weak.upgrade())
    }

    fn unbind(&self, token: &Token) {
        let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        bound.retain(|(t, weak)| t != token && weak.strong_count() > 0);
    }

    async fn conn(&self, name: &str) -> Result<Object, LockError> {
        self.pool
            .get()
            .await
            .map_err(|e| database_error(name, false, e))
    }

    /// `sql` with `params` on a pooled connection; the rows.
    async fn query(
        &self,
        name: &str,
        ambiguous: bool,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, LockError> {
        let conn = self.conn(name).await?;
        let statement = conn
            .prepare_cached(sql)
            .await
            .map_err(|e| database_error(name, false, e))?;
        conn.query(&statement, params)
            .await
            .map_err(|e| database_error(name, ambiguous, e))
    }

    async fn acquire_now(&self, op: &Op) -> Result<Attempt, LockError> {
        let name = op.name.lock_key();
        let (once, tag) = match &op.mode {
            Mode::Once { tag, .. } => (true, tag.to_vec()),
            Mode::Exclusive => (false, Vec::new()),
            Mode::Reentrant { .. } => return Err(self.unsupported(&op.name, "reentrant locks")),
        };
        let rows = self
            .query(
                name,
                true,
                &self.sql.acquire,
                &[
                    &name,
                    &op.token.as_str(),
                    &i64_of(millis(op.lease)),
                    &i64_of(op.state_ttl_ms()),
                    &once,
                    &tag,
                    &i64_of(counter_start()),
                ],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| LockError::protocol(name, "acquire: no row"))?;
        let kind: i32 = row.get(0);
        let fence = row.get::<_, Option<i64>>(1).unwrap_or(0).max(0) as u64;
        let parts = row.get::<_, Option<i64>>(5).unwrap_or(0).max(0) as u64;
        Ok(match kind {
            1 => Attempt::Acquired {
                fence: if once || op.fencing { fence } else { 0 },
            },
            2 => {
                let first = row.get::<_, Option<Vec<u8>>>(4);
                if parts == 0 {
                    return Err(LockError::protocol(name, "acquire: a record of no parts"));
                }
                let Some(first) = first else {
                    return Err(LockError::broken(
                        name,
                        format!("part 0 of {parts} is missing"),
                    ));
                };
                Attempt::Done {
                    record: Record::new(Bytes::from(first), parts),
                }
            }
            _ => Attempt::Held {
                ttl: row
                    .get::<_, Option<i64>>(2)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                tag: once
                    .then(|| Bytes::from(row.get::<_, Option<Vec<u8>>>(3).unwrap_or_default())),
                fence: if once { fence } else { 0 },
                parts: if once { parts } else { 0 },
            },
        })
    }

    /// Opens a transaction on a pooled connection that locks `op`'s row while `op` holds it.
    pub(crate) async fn bind_now(&self, op: &Op) -> Result<Transaction, LockError> {
        let name = op.name.lock_key();
        let conn = self.conn(name).await?;
        conn.batch_execute("BEGIN")
            .await
            .map_err(|e| database_error(name, false, e))?;
        let bound = Arc::new(Bound {
            name: name.to_owned(),
            conn: Some(conn),
            ended: std::sync::atomic::AtomicBool::new(false),
        });
        let locked = bound
            .conn()
            .query(&self.sql.lock_row, &[&name, &op.token.as_str()])
            .await
            .map_err(|e| database_error(name, false, e))?;
        if locked.is_empty() {
            return Err(LockError::LeaseLost {
                name: op.name.as_str().to_owned(),
                reason: crate::LossReason::NotOwner,
            });
        }
        self.bound
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((op.token, Arc::downgrade(&bound)));
        Ok(Transaction { inner: bound })
    }

    async fn extend_now(&self, op: &Op, lease: Duration) -> Result<bool, LockError> {
        let name = op.name.lock_key();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&name, &op.token.as_str(), &i64_of(millis(lease))];
        // A bound holder renews in its transaction, which holds the row (the renewal cannot be
        // seen before the commit, and needs not be: nobody else gets past the row lock).
        if let Some(bound) = self.bound(&op.token) {
            return bound
                .conn()
                .execute(&self.sql.extend, &params)
                .await
                .map(|n| n == 1)
                .map_err(|e| database_error(name, false, e));
        }
        Ok(!self
            .query(name, false, &self.sql.extend, &params)
            .await?
            .is_empty())
    }

    async fn release_now(&self, op: &Op) -> Result<bool, LockError> {
        let name = op.name.lock_key();
        if let Some(bound) = self.bound(&op.token) {
            // The work's writes go: rolled back before the lock is let go.
            let _ = bound.conn().batch_execute("ROLLBACK").await;
            bound
                .ended
                .store(true, std::sync::atomic::Ordering::Release);
            self.unbind(&op.token);
        }
        let rows = self
            .query(name, false, &self.sql.release, &[&name, &op.token.as_str()])
            .await?;
        Ok(!rows.is_empty())
    }

    /// The holder's lease left, `Some(None)` for a name without a holder, `None` for no row.
    async fn exists(&self, name: &str) -> Result<Option<Option<i64>>, LockError> {
        let rows = self.query(name, false, &self.sql.exists, &[&name]).await?;
        Ok(rows.first().map(|row| row.get::<_, Option<i64>>(0)))
    }

    async fn complete_now(&self, op: &Op, record: &[u8], appended: u64) -> Result<bool, LockError> {
        let name = op.name.lock_key();
        let retention = i64_of(op.state_ttl_ms());
        // -1: a one-part record in place of the parts stored.
        let appended_arg = if appended == REPLACE_PARTS {
            -1
        } else {
            i64_of(appended)
        };
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
            &name,
            &op.token.as_str(),
            &record,
            &retention,
            &appended_arg,
        ];
        let broken = |held: i64| {
            LockError::broken(
                op.name.as_str(),
                format!(
                    "{appended} parts were appended, the store holds {}",
                    (-1 - held).max(0)
                ),
            )
        };
        let whole = &params[..4];
        if let Some(bound) = self.bound(&op.token) {
            // The record with the work's writes (and the parts appended in the transaction),
            // in one commit.
            let conn = bound.conn();
            let fast = appended == 0
                && conn
                    .execute(&self.sql.complete_whole, whole)
                    .await
                    .map_err(|e| database_error(name, false, e))?
                    == 1;
            let answer: i64 = if fast {
                1
            } else {
                conn.query_one(&self.sql.complete, &params)
                    .await
                    .map_err(|e| database_error(name, false, e))?
                    .get(0)
            };
            if answer < 0 {
                // Nothing written: the guard still holds the lock, and the transaction is open.
                return Err(broken(answer));
            }
            if answer != 1 {
                let _ = conn.batch_execute("ROLLBACK").await;
                bound
                    .ended
                    .store(true, std::sync::atomic::Ordering::Release);
                self.unbind(&op.token);
                return Ok(false);
            }
            let committed = conn.batch_execute("COMMIT").await;
            bound
                .ended
                .store(true, std::sync::atomic::Ordering::Release);
            self.unbind(&op.token);
            // A commit whose answer is lost may have happened.
            committed.map_err(|e| database_error(name, true, e))?;
            return Ok(true);
        }
        if appended == 0
            && !self
                .query(name, true, &self.sql.complete_whole, whole)
                .await?
                .is_empty()
        {
            return Ok(true);
        }
        // A completion whose answer was lost, sent again, is recognised by its token.
        let rows = self.query(name, true, &self.sql.complete, &params).await?;
        let answer: i64 = rows
            .first()
            .and_then(|row| row.get::<_, Option<i64>>(0))
            .ok_or_else(|| LockError::protocol(name, "complete: no answer"))?;
        match answer {
            1 => Ok(true),
            0 => Ok(false),
            held => Err(broken(held)),
        }
    }

    async fn append_now(&self, op: &Op, index: u64, part: &[u8]) -> Result<Appended, LockError> {
        let name = op.name.lock_key();
        let retention = i64_of(op.state_ttl_ms());
        // No record reaches the largest indexes: past them, any index is as much a mismatch
        // (and `index + 1` stays a bigint).
        let index = i64_of(index).min(i64::MAX - 1);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&name, &op.token.as_str(), &index, &part, &retention];
        // A bound holder appends in its transaction, which holds the row (an append on another
        // connection would wait for it): the parts commit with the record.
        let rows = match self.bound(&op.token) {
            Some(bound) => bound
                .conn()
                .query(&self.sql.append, &params)
                .await
                .map_err(|e| database_error(name, true, e))?,
            None => self.query(name, true, &self.sql.append, &params).await?,
        };
        let answer: i64 = rows
            .first()
            .and_then(|row| row.get::<_, Option<i64>>(0))
            .ok_or_else(|| LockError::protocol(name, "append: no answer"))?;
        Ok(match answer {
            1 => Appended::Stored,
            0 => Appended::NotOwner,
            held if held < 0 => Appended::Mismatch {
                len: (-1 - held) as u64,
            },
            other => {
                return Err(LockError::protocol(
                    name,
                    format!("append: unexpected answer {other}"),
                ));
            }
        })
    }

    /// The parts from `from` (up to `max`) as bounds of `idx`: `[start, end)`.
    fn part_range(from: u64, max: usize) -> (i64, i64) {
        let start = i64_of(from);
        let end = i64_of(from.saturating_add(u64::try_from(max).unwrap_or(u64::MAX)));
        (start, end)
    }

    async fn parts_now(&self, name: &LockName, from: u64, max: usize) -> Result<Parts, LockError> {
        let key = name.lock_key();
        let (start, end) = Self::part_range(from, max);
        let rows = self
            .query(key, false, &self.sql.parts, &[&key, &start, &end])
            .await?;
        let Some(row) = rows.first() else {
            return Ok(Parts::new(
                from,
                Vec::new(),
                0,
                RecordState::Abandoned,
                None,
            ));
        };
        let fence = row.get::<_, Option<i64>>(0).unwrap_or(0).max(0) as u64;
        let (claimed, held, live): (bool, bool, bool) = (row.get(1), row.get(2), row.get(3));
        let record_parts = row.get::<_, Option<i64>>(4).map(|n| n.max(0) as u64);
        let stored = row.get::<_, i64>(5).max(0) as u64;
        let lease_ms: Option<i64> = row.get(6);
        let whole: bool = row.get(7);
        let listed = || -> Vec<Bytes> {
            rows.iter()
                .filter_map(|row| row.get::<_, Option<Vec<u8>>>(9))
                .map(Bytes::from)
                .collect()
        };
        if live && let Some(count) = record_parts {
            if whole {
                let parts = row
                    .get::<_, Option<Vec<u8>>>(8)
                    .map(Bytes::from)
                    .into_iter()
                    .collect();
                return Ok(Parts::new(
                    from,
                    parts,
                    fence,
                    RecordState::Done { parts: 1 },
                    None,
                ));
            }
            if count == 0 {
                return Err(LockError::protocol(key, "parts: a record of no parts"));
            }
            if stored < count {
                return Err(LockError::broken(
                    name.as_str(),
                    format!("the record has {count} parts, the store holds {stored}"),
                ));
            }
            return Ok(Parts::new(
                from,
                listed(),
                fence,
                RecordState::Done { parts: count },
                None,
            ));
        }
        if held {
            let lease_left = lease_ms.map(|ms| Duration::from_millis(ms.max(0) as u64));
            return Ok(Parts::new(
                from,
                listed(),
                fence,
                RecordState::Writing { parts: stored },
                lease_left,
            ));
        }
        // The lease seen is over, but a transaction bound to it may hold the row (renewed in the
        // transaction, which nobody sees before it ends): then it is still being written.
        // Rare (a writer that died or lost its lease), so the lock is looked for only then.
        if claimed
            && self
                .query(key, false, &self.sql.locked, &[&key])
                .await?
                .is_empty()
            && self.exists(key).await?.is_some()
        {
            return Ok(Parts::new(
                from,
                listed(),
                fence,
                RecordState::Writing { parts: stored },
                None,
            ));
        }
        Ok(Parts::new(
            from,
            Vec::new(),
            if live { fence } else { 0 },
            RecordState::Abandoned,
            None,
        ))
    }

    async fn stored_parts_now(
        &self,
        name: &LockName,
        from: u64,
        max: usize,
    ) -> Result<Vec<Bytes>, LockError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let key = name.lock_key();
        let (start, end) = Self::part_range(from, max);
        let rows = self
            .query(key, false, &self.sql.stored_parts, &[&key, &start, &end])
            .await?;
        if rows.is_empty() {
            // Nothing there (a one-part record has no parts rows; a part past the end; a
            // record gone): the atomic read says what there is, or what is wrong.
            return Ok(self.parts_now(name, from, max).await?.into_parts());
        }
        Ok(rows
            .iter()
            .map(|row| Bytes::from(row.get::<_, Vec<u8>>(0)))
            .collect())
    }

    async fn inspect_now(&self, name: &LockName) -> Result<Inspection, LockError> {
        let key = name.lock_key();
        let rows = self.query(key, false, &self.sql.inspect, &[&key]).await?;
        let Some(row) = rows.first() else {
            return Ok(Inspection {
                holder: None,
                record: None,
                fence: None,
                expires_in: None,
            });
        };
        let held: bool = row.get::<_, Option<bool>>(0).unwrap_or(false);
        let lease_ms: Option<i64> = row.get(1);
        let fence = row.get::<_, Option<i64>>(2).map(|f| f.max(0) as u64);
        let since = row
            .get::<_, Option<i64>>(4)
            .map(|us| std::time::UNIX_EPOCH + Duration::from_micros(us.max(0) as u64));
        // A streamed record shows as a record of its parts: the first and the count.
        let count = row.get::<_, Option<i64>>(7).unwrap_or(1).max(1) as u64;
        let record = row
            .get::<_, Option<Vec<u8>>>(5)
            .map(|r| Record::new(Bytes::from(r), count));
        let expires_in = row
            .get::<_, Option<i64>>(6)
            .map(|ms| Duration::from_millis(ms.max(0) as u64));
        Ok(Inspection {
            holder: held.then(|| Holder {
                lease_left: lease_ms.map(|ms| Duration::from_millis(ms.max(0) as u64)),
                fence: fence.unwrap_or(0),
                tag: Bytes::from(row.get::<_, Option<Vec<u8>>>(3).unwrap_or_default()),
                since,
            }),
            record,
            fence,
            expires_in,
        })
    }

    async fn purge_now(&self, name: &LockName) -> Result<Purged, LockError> {
        let key = name.lock_key();
        let rows = self.query(key, true, &self.sql.purge, &[&key]).await?;
        if let Some(row) = rows.first() {
            return Ok(if row.get::<_, Option<bool>>(0).unwrap_or(false) {
                Purged::Deleted
            } else {
                Purged::Absent
            });
        }
        match self.exists(key).await? {
            None => Ok(Purged::Absent),
            Some(lease_ms) => Ok(Purged::InFlight {
                lease_left: lease_ms.map(|ms| Duration::from_millis(ms.max(0) as u64)),
            }),
        }
    }

    async fn scan_now(&self, prefix: &str, pattern: &str) -> Result<Vec<String>, LockError> {
        let separator = if prefix.is_empty() { "" } else { ":" };
        let start = format!("{prefix}{separator}{{");
        let mut like = escape_like(&start);
        for c in pattern.chars() {
            match c {
                '*' => like.push('%'),
                '?' => like.push('_'),
                c => like.push_str(&escape_like(&c.to_string())),
            }
        }
        like.push('}');
        let rows = self.query(pattern, false, &self.sql.scan, &[&like]).await?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let key: String = row.get(0);
                Some(
                    key.strip_prefix(start.as_str())?
                        .strip_suffix('}')?
                        .to_owned(),
                )
            })
            .collect())
    }

    async fn prepare_now(&self) -> Result<Vec<StoreWarning>, LockError> {
        let name = self.table.as_str();
        let mut conn = self.conn(name).await?;
        let tx = conn
            .transaction()
            .await
            .map_err(|e| database_error(name, false, e))?;
        // Instances preparing at once would race on the function's definition.
        tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&name])
            .await
            .map_err(|e| database_error(name, false, e))?;
        tx.batch_execute(&self.sql.schema)
            .await
            .map_err(|e| database_error(name, false, e))?;
        tx.commit()
            .await
            .map_err(|e| database_error(name, false, e))?;
        Ok(Vec::new())
    }
}

/// `text` with LIKE's wildcards and escape escaped.
fn escape_like(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Deletes expired rows every [`SWEEP_EVERY`], at most [`SWEEP_BATCH`] at a time, while the
/// backend lives.
async fn sweep(backend: Weak<PostgresBackend>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(backend) = backend.upgrade() else {
            return;
        };
        if let Err(error) = backend
            .query(&backend.table, false, &backend.sql.sweep, &[&SWEEP_BATCH])
            .await
        {
            tracing::debug!(%error, "distlock: sweeping expired rows failed; trying again later");
        }
    }
}

impl Backend for PostgresBackend {
    fn acquire<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(self.acquire_now(op))
    }

    fn extend<'a>(&'a self, op: &'a Op, lease: Duration) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.extend_now(op, lease))
    }

    fn release<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.release_now(op))
    }

    fn complete<'a>(
        &'a self,
        op: &'a Op,
        record: &'a [u8],
        appended: u64,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.complete_now(op, record, appended))
    }

    fn append<'a>(
        &'a self,
        op: &'a Op,
        index: u64,
        part: &'a [u8],
    ) -> BoxFuture<'a, Result<Appended, LockError>> {
        Box::pin(self.append_now(op, index, part))
    }

    fn parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Parts, LockError>> {
        Box::pin(self.parts_now(name, from, max))
    }

    fn stored_parts<'a>(
        &'a self,
        name: &'a LockName,
        from: u64,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<Bytes>, LockError>> {
        Box::pin(self.stored_parts_now(name, from, max))
    }

    fn supports_streaming(&self) -> bool {
        true
    }

    /// Each operation takes a connection of the pool: a later one may overtake one on its way.
    fn sends_in_order(&self) -> bool {
        false
    }

    fn inspect<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Inspection, LockError>> {
        Box::pin(self.inspect_now(name))
    }

    fn purge<'a>(&'a self, name: &'a LockName) -> BoxFuture<'a, Result<Purged, LockError>> {
        Box::pin(self.purge_now(name))
    }

    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        pattern: &'a str,
    ) -> BoxFuture<'a, Result<Vec<String>, LockError>> {
        Box::pin(self.scan_now(prefix, pattern))
    }

    fn bind<'a>(&'a self, op: &'a Op) -> BoxFuture<'a, Result<Transaction, LockError>> {
        Box::pin(self.bind_now(op))
    }

    fn supports_transactions(&self) -> bool {
        true
    }

    fn max_record_len(&self, _config: &crate::LockConfig) -> usize {
        MAX_RECORD
    }

    fn prepare<'a>(
        &'a self,
        _probe: &'a LockName,
    ) -> BoxFuture<'a, Result<Vec<StoreWarning>, LockError>> {
        Box::pin(self.prepare_now())
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    fn describe(&self) -> String {
        format!("postgres (table {})", self.table)
    }
}

#[cfg(test)]
mod tests {
    //! The statements' semantics on a real PostgreSQL, below the guard (which numbers its own
    //! appends): parts placed by index, a retried append recognised, anything else refused.

    use super::*;

    /// A backend on a table of its own in the tests' shared server, prepared.
    async fn backend(test: &str) -> Arc<PostgresBackend> {
        let server = testkit::PostgresServer::shared().await;
        let config: tokio_postgres::Config = server.url().parse().unwrap();
        let manager = deadpool_postgres::Manager::from_config(
            config,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(4)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .unwrap();
        let backend = PostgresBackend::new(pool, &testkit::unique_table(test)).unwrap();
        let probe = LockName::new("t", "probe").unwrap();
        backend.prepare(&probe).await.unwrap();
        backend
    }

    fn op(name: &str, lease: Duration, retention: Duration) -> Op {
        Op {
            name: LockName::new("t", name).unwrap(),
            token: Token::random(),
            lease,
            drift: Duration::from_millis(2),
            fencing: true,
            state_ttl: None,
            mode: Mode::Once {
                tag: Bytes::from_static(b"tag"),
                retention,
            },
        }
    }

    fn long(name: &str) -> Op {
        op(name, Duration::from_secs(30), Duration::from_secs(3600))
    }

    /// Rows of the parts table for `op`'s name, and the part count kept in its row.
    async fn counted(backend: &PostgresBackend, op: &Op) -> (i64, Option<i64>) {
        let key = op.name.lock_key();
        let rows = backend
            .query(
                key,
                false,
                &format!(
                    "SELECT (SELECT count(*) FROM {0}_parts WHERE name = $1), \
                     (SELECT stored FROM {0} WHERE name = $1)",
                    backend.table
                ),
                &[&key],
            )
            .await
            .unwrap();
        (rows[0].get(0), rows[0].get(1))
    }

    async fn taken(backend: &PostgresBackend, op: &Op) -> u64 {
        match backend.acquire(op).await.unwrap() {
            Attempt::Acquired { fence } => fence,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn appends_are_placed_by_index_and_a_retry_is_recognised() {
        let backend = backend("pg_append").await;
        let writer = long("a");
        taken(&backend, &writer).await;
        let append = |index: u64, part: &'static [u8]| {
            let (backend, writer) = (backend.clone(), writer.clone());
            async move { backend.append(&writer, index, part).await.unwrap() }
        };
        assert_eq!(append(0, b"p0").await, Appended::Stored);
        // The same part at the same index: an append whose answer was lost, sent again.
        assert_eq!(append(0, b"p0").await, Appended::Stored);
        assert_eq!(counted(&backend, &writer).await, (1, Some(1)));
        // Another part at the last index, a gap, an index long past: refused, nothing stored.
        assert_eq!(append(0, b"other").await, Appended::Mismatch { len: 1 });
        assert_eq!(append(2, b"p2").await, Appended::Mismatch { len: 1 });
        assert_eq!(append(u64::MAX, b"p").await, Appended::Mismatch { len: 1 });
        assert_eq!(append(1, b"p1").await, Appended::Stored);
        assert_eq!(append(0, b"p0").await, Appended::Mismatch { len: 2 });
        // Another token on the same name: not the holder's.
        let stranger = Op {
            token: Token::random(),
            ..writer.clone()
        };
        assert_eq!(
            backend.append(&stranger, 2, b"x").await.unwrap(),
            Appended::NotOwner
        );
        assert!(!backend.complete(&stranger, b"x", 2).await.unwrap());
        let held = backend.parts(&writer.name, 0, 8).await.unwrap();
        assert_eq!(held.state(), RecordState::Writing { parts: 2 });
        assert_eq!(held.parts(), [&b"p0"[..], b"p1"]);
        // A completion that counts other parts than the store holds: nothing touched, the
        // writer still holds and appends.
        assert!(matches!(
            backend.complete(&writer, b"end", 5).await,
            Err(LockError::BrokenRecord { .. })
        ));
        assert!(matches!(
            backend.complete(&writer, b"end", 0).await,
            Err(LockError::BrokenRecord { .. })
        ));
        assert_eq!(append(2, b"p2").await, Appended::Stored);
        assert!(backend.complete(&writer, b"end", 3).await.unwrap());
        // The completion sent again (its answer lost): recognised by its token.
        assert!(backend.complete(&writer, b"end", 3).await.unwrap());
        assert_eq!(counted(&backend, &writer).await, (4, Some(4)));
        let done = backend.parts(&writer.name, 0, 8).await.unwrap();
        assert_eq!(done.state(), RecordState::Done { parts: 4 });
        assert_eq!(done.parts(), [&b"p0"[..], b"p1", b"p2", b"end"]);
        assert_eq!(
            backend.stored_parts(&writer.name, 1, 2).await.unwrap(),
            [&b"p1"[..], b"p2"]
        );
        // Appends after the completion: the lock is no longer held.
        assert_eq!(append(4, b"late").await, Appended::NotOwner);
        match backend.acquire(&long("a")).await.unwrap() {
            Attempt::Done { record } => {
                assert_eq!((&record.first()[..], record.parts()), (&b"p0"[..], 4));
            }
            other => panic!("{other:?}"),
        }
        let inspected = backend.inspect(&writer.name).await.unwrap();
        let record = inspected.record.expect("a record of its parts");
        assert_eq!((&record.first()[..], record.parts()), (&b"p0"[..], 4));
    }

    #[tokio::test]
    async fn a_whole_record_replaces_the_parts() {
        let backend = backend("pg_replace").await;
        let writer = long("r");
        taken(&backend, &writer).await;
        for (i, part) in [&b"a"[..], b"b"].into_iter().enumerate() {
            let stored = backend.append(&writer, i as u64, part).await.unwrap();
            assert_eq!(stored, Appended::Stored);
        }
        assert!(
            backend
                .complete(&writer, b"summary", REPLACE_PARTS)
                .await
                .unwrap()
        );
        assert_eq!(counted(&backend, &writer).await, (0, Some(0)));
        let done = backend.parts(&writer.name, 0, 8).await.unwrap();
        assert_eq!(done.state(), RecordState::Done { parts: 1 });
        assert_eq!(done.parts(), [&b"summary"[..]]);
    }

    /// A one-part record (the plain statement) and its completion sent again (the function,
    /// which recognises the token); a stranger's completion stores nothing.
    #[tokio::test]
    async fn a_whole_record_and_its_retried_completion() {
        let backend = backend("pg_whole").await;
        let writer = long("one");
        taken(&backend, &writer).await;
        let stranger = Op {
            token: Token::random(),
            ..writer.clone()
        };
        assert!(!backend.complete(&stranger, b"x", 0).await.unwrap());
        assert!(backend.complete(&writer, b"whole", 0).await.unwrap());
        assert!(backend.complete(&writer, b"whole", 0).await.unwrap());
        assert!(!backend.complete(&stranger, b"x", 0).await.unwrap());
        let done = backend.parts(&writer.name, 0, 8).await.unwrap();
        assert_eq!(done.state(), RecordState::Done { parts: 1 });
        assert_eq!(done.parts(), [&b"whole"[..]]);
        assert_eq!(counted(&backend, &writer).await, (0, Some(0)));
    }

    /// A writer's lease ends mid-stream: it appends nothing more, its parts are no record, and
    /// the next writer starts from none of them (deleted when it takes the name).
    #[tokio::test]
    async fn the_next_writer_starts_from_none_of_an_abandoned_writers_parts() {
        let backend = backend("pg_abandoned").await;
        let short = Duration::from_millis(150);
        let old = op("w", short, Duration::from_secs(3600));
        let old_fence = taken(&backend, &old).await;
        assert_eq!(
            backend.append(&old, 0, b"old").await.unwrap(),
            Appended::Stored
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            backend.append(&old, 1, b"late").await.unwrap(),
            Appended::NotOwner
        );
        assert_eq!(
            backend.append(&old, 0, b"old").await.unwrap(),
            Appended::NotOwner,
            "not even a retry once the lease is over"
        );
        let read = backend.parts(&old.name, 0, 8).await.unwrap();
        assert_eq!(read.state(), RecordState::Abandoned);
        assert!(read.parts().is_empty());
        let new = long("w");
        assert!(taken(&backend, &new).await > old_fence);
        assert_eq!(counted(&backend, &new).await, (0, Some(0)));
        let read = backend.parts(&new.name, 0, 8).await.unwrap();
        assert_eq!(read.state(), RecordState::Writing { parts: 0 });
        assert_eq!(
            backend.append(&new, 0, b"new").await.unwrap(),
            Appended::Stored
        );
        // Released without a record: the parts go with the lock.
        assert!(backend.release(&new).await.unwrap());
        assert_eq!(counted(&backend, &new).await, (0, Some(0)));
    }

    /// The sweep deletes an expired record's row, and its parts with it.
    #[tokio::test]
    async fn the_sweep_takes_the_parts_along() {
        let backend = backend("pg_sweep").await;
        let writer = op("s", Duration::from_secs(30), Duration::from_millis(100));
        taken(&backend, &writer).await;
        assert_eq!(
            backend.append(&writer, 0, b"a").await.unwrap(),
            Appended::Stored
        );
        assert!(backend.complete(&writer, b"b", 1).await.unwrap());
        assert_eq!(counted(&backend, &writer).await, (2, Some(2)));
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Expired: no record, whatever is left until the sweep.
        assert_eq!(
            backend.parts(&writer.name, 0, 8).await.unwrap().state(),
            RecordState::Abandoned
        );
        backend
            .query(&backend.table, false, &backend.sql.sweep, &[&SWEEP_BATCH])
            .await
            .unwrap();
        assert_eq!(counted(&backend, &writer).await, (0, None));
    }
}
