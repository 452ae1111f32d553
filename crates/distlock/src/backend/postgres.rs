//! The lock and its run-once records in a PostgreSQL table (feature `postgres`), through a
//! `deadpool-postgres` pool of `tokio-postgres` connections.
//!
//! One row per name: the holder's token and lease (by the database's clock), the fencing
//! counter, the holder's tag and since when it holds, the completed record and when it
//! expires. Every operation is one statement (the acquisition one function call), in its own
//! transaction, on a connection taken from the pool for its duration only: a waiting request
//! holds no connection between its looks.
//!
//! A guard can also [bind a transaction](crate::OnceGuard::transaction): a connection of the
//! pool with a transaction open, that holds the name's row locked (`FOR UPDATE`) until it ends.
//! The work does its writes in it, and the completion stores the record in it and commits:
//! either both commit, or neither does. While it is open the row lock keeps everyone else out
//! (their acquisitions skip the locked row and report it held, never wait on it), so the lease
//! is renewed in it and nowhere else; when the process dies, the database ends the transaction
//! and the lock with its connection, and the lease (by then past) lets the next holder in.
//!
//! | column | holds |
//! |---|---|
//! | `name` | the lock key (`prefix:{name}`) |
//! | `token`, `lease_until` | the holder's token and lease, `NULL` when nobody holds |
//! | `fence` | the fencing counter (a new one starts from the caller's clock in microseconds) |
//! | `tag`, `since` | the holder's tag and since when it holds |
//! | `record`, `completed_by` | the completed record and the token that stored it |
//! | `expires_at` | when the state (record, counter) expires: `NULL` for never |
//!
//! Expired rows are deleted by a sweep every minute, at most 1,000 at a time, and ignored
//! until then.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Object, Pool};

use super::waiters::Waiters;
use super::{Attempt, Backend, BoxFuture, Mode, Op, REPLACE_PARTS, millis};
use crate::once::{Holder, Inspection, Purged, Record};
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
    completed_by: String,
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
    expires_at timestamptz
);
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
CREATE OR REPLACE FUNCTION {function}(
    p_name text, p_token text, p_lease_ms bigint, p_state_ms bigint, p_once boolean,
    p_tag bytea, p_start bigint)
RETURNS TABLE(kind int, fence bigint, ttl_ms bigint, holder_tag bytea, rec bytea)
LANGUAGE plpgsql AS $$
DECLARE
    r {table}%ROWTYPE;
    now_ts timestamptz;
    state_until timestamptz;
    locked boolean;
BEGIN
    LOOP
        now_ts := clock_timestamp();
        state_until := CASE WHEN p_state_ms > 0 THEN now_ts + p_state_ms {ms} END;
        INSERT INTO {table} (name, token, lease_until, fence, tag, since, expires_at)
        VALUES (p_name, p_token, now_ts + p_lease_ms {ms}, p_start + 1, p_tag, now_ts,
            state_until)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN QUERY SELECT 1, p_start + 1, NULL::bigint, NULL::bytea, NULL::bytea;
            RETURN;
        END IF;
        SELECT * INTO r FROM {table} t WHERE t.name = p_name FOR UPDATE SKIP LOCKED;
        EXIT WHEN FOUND;
        -- Another transaction has the row locked: what it holds, as committed.
        SELECT * INTO r FROM {table} t WHERE t.name = p_name;
        IF FOUND THEN
            IF r.token IS NOT NULL AND r.lease_until > now_ts THEN
                -- A live holder (a bound transaction keeps its row locked): held. Never
                -- waited on.
                RETURN QUERY SELECT 0, r.fence,
                    GREATEST(0, (EXTRACT(EPOCH FROM (r.lease_until - now_ts)) * 1000)::bigint),
                    r.tag, NULL::bytea;
                RETURN;
            END IF;
            IF p_once AND r.token IS NULL AND r.record IS NOT NULL
                AND (r.expires_at IS NULL OR r.expires_at > now_ts) THEN
                -- Completed: a record never changes (a purge deletes it whole).
                RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea, r.record;
                RETURN;
            END IF;
            -- Free, or past its lease: the lock is a statement being committed (a completion,
            -- a release, another caller taking it), or a holder's transaction past its lease.
            -- Waited for, briefly; still locked after that, it is held.
            BEGIN
                PERFORM set_config('lock_timeout', '1000', true);
                SELECT * INTO r FROM {table} t WHERE t.name = p_name FOR UPDATE;
                locked := FOUND;
            EXCEPTION WHEN lock_not_available THEN
                RETURN QUERY SELECT 0, r.fence, 0::bigint, r.tag, NULL::bytea;
                RETURN;
            END;
            now_ts := clock_timestamp();
            state_until := CASE WHEN p_state_ms > 0 THEN now_ts + p_state_ms {ms} END;
            EXIT WHEN locked;
        END IF;
        -- Deleted meanwhile (a purge, the sweep): from the start.
    END LOOP;
    IF r.token IS NOT NULL AND r.lease_until > now_ts THEN
        IF r.token = p_token THEN
            -- The same attempt sent again: taken, with the fence it drew.
            RETURN QUERY SELECT 1, r.fence, NULL::bigint, NULL::bytea, NULL::bytea;
        ELSE
            RETURN QUERY SELECT 0, r.fence,
                GREATEST(0, (EXTRACT(EPOCH FROM (r.lease_until - now_ts)) * 1000)::bigint),
                r.tag, NULL::bytea;
        END IF;
        RETURN;
    END IF;
    IF r.expires_at IS NOT NULL AND r.expires_at <= now_ts THEN
        -- The state expired: a new counter starts from the caller's clock.
        r.fence := NULL;
        r.record := NULL;
    END IF;
    IF p_once AND r.record IS NOT NULL THEN
        RETURN QUERY SELECT 2, r.fence, NULL::bigint, NULL::bytea, r.record;
        RETURN;
    END IF;
    UPDATE {table} t SET token = p_token, lease_until = now_ts + p_lease_ms {ms},
        fence = COALESCE(r.fence, p_start) + 1, tag = p_tag, since = now_ts, record = NULL,
        completed_by = NULL, expires_at = state_until
    WHERE t.name = p_name;
    RETURN QUERY SELECT 1, COALESCE(r.fence, p_start) + 1, NULL::bigint, NULL::bytea, NULL::bytea;
END
$$;
"#
            ),
            acquire: format!(
                "SELECT kind, fence, ttl_ms, holder_tag, rec FROM {function}($1, $2, $3, $4, $5, $6, $7)"
            ),
            extend: format!(
                "UPDATE {table} SET lease_until = clock_timestamp() + $3::bigint {ms} \
                 WHERE name = $1 AND token = $2 RETURNING 1"
            ),
            release: format!(
                "UPDATE {table} SET token = NULL, lease_until = NULL, tag = NULL \
                 WHERE name = $1 AND token = $2 RETURNING 1"
            ),
            complete: format!(
                "UPDATE {table} SET record = $3, completed_by = $2, token = NULL, \
                 lease_until = NULL, tag = NULL, expires_at = clock_timestamp() + $4::bigint {ms} \
                 WHERE name = $1 AND token = $2 RETURNING 1"
            ),
            completed_by: format!(
                "UPDATE {table} SET expires_at = clock_timestamp() + $3::bigint {ms} \
                 WHERE name = $1 AND completed_by = $2 AND token IS NULL RETURNING 1"
            ),
            lock_row: format!("SELECT 1 FROM {table} WHERE name = $1 AND token = $2 FOR UPDATE"),
            inspect: format!(
                "SELECT token IS NOT NULL AND lease_until > clock_timestamp(), \
                 (EXTRACT(EPOCH FROM (lease_until - clock_timestamp())) * 1000)::bigint, \
                 fence, tag, (EXTRACT(EPOCH FROM since) * 1000000)::bigint, \
                 CASE WHEN expires_at IS NULL OR expires_at > clock_timestamp() THEN record END, \
                 (EXTRACT(EPOCH FROM (expires_at - clock_timestamp())) * 1000)::bigint \
                 FROM {table} WHERE name = $1 \
                 AND (expires_at IS NULL OR expires_at > clock_timestamp() \
                      OR (token IS NOT NULL AND lease_until > clock_timestamp()))"
            ),
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
        Ok(match kind {
            1 => Attempt::Acquired {
                fence: if once || op.fencing { fence } else { 0 },
            },
            2 => Attempt::Done {
                record: Record::new(Bytes::from(row.get::<_, Vec<u8>>(4)), 1),
            },
            _ => Attempt::Held {
                ttl: row
                    .get::<_, Option<i64>>(2)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                tag: once
                    .then(|| Bytes::from(row.get::<_, Option<Vec<u8>>>(3).unwrap_or_default())),
                fence: if once { fence } else { 0 },
                parts: 0,
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
        if appended != 0 && appended != REPLACE_PARTS {
            return Err(self.unsupported(&op.name, "append"));
        }
        let retention = i64_of(op.state_ttl_ms());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&name, &op.token.as_str(), &record, &retention];
        if let Some(bound) = self.bound(&op.token) {
            // The record with the work's writes, in one commit.
            let conn = bound.conn();
            let stored = conn
                .execute(&self.sql.complete, &params)
                .await
                .map_err(|e| database_error(name, false, e))?;
            if stored != 1 {
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
        if !self
            .query(name, true, &self.sql.complete, &params)
            .await?
            .is_empty()
        {
            return Ok(true);
        }
        // A completion whose answer was lost, sent again: recognised by its token.
        let again = self
            .query(
                name,
                false,
                &self.sql.completed_by,
                &[&name, &op.token.as_str(), &retention],
            )
            .await?;
        Ok(!again.is_empty())
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
        let record = row
            .get::<_, Option<Vec<u8>>>(5)
            .map(|r| Record::new(Bytes::from(r), 1));
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

/// Where a new fencing counter starts: this machine's clock in microseconds (as on Redis).
fn counter_start() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
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

    /// A pool: a statement handed to one connection may run after a later one on another.
    fn sends_in_order(&self) -> bool {
        false
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
