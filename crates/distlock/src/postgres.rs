//! The Postgres store (feature `postgres`): locks and run-once records in a table, and run-once
//! work whose writes commit with its record ([`Transaction`]).
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use distlock::{Begin, LockClient};
//! let client = LockClient::builder().connect_postgres("postgres://app@127.0.0.1/app", "distlock")?;
//! client.prepare().await?; // creates the table and its function if missing
//! let once = client.once("payment-7")?;
//! if let Begin::Acquired(guard) = once.begin("").await? {
//!     let tx = guard.transaction().await?;
//!     tx.execute("INSERT INTO payments (id) VALUES ('7')", &[]).await?;
//!     guard.complete(b"paid").await?; // the row and the record commit together
//! }
//! # Ok(()) }
//! ```

pub use crate::backend::postgres::Transaction;
