//! Sending a lock script: as `FCALL` of its function while the server has the library, as
//! `EVALSHA` once it shows it cannot (see [`scripts`](super::scripts)), loading what is missing
//! on the way.
//!
//! What turns a server to scripts for good: `FCALL` unknown (Redis 6, renamed away) or refused to
//! the user, or the library missing and `FUNCTION LOAD` refused or rejected. What turns one call
//! into a script, once: `FCALL` refused before it ran because the server takes no writes now
//! (out of memory, a failed save, too few replicas), or the library missing and not loadable
//! now. A function without the `allow-oom` or `no-writes` flag is refused whole in those
//! states, where the same script sent with `EVALSHA` runs and is stopped only at its first write:
//! a replay (a `begin` that finds the record) must keep working on a full Redis.

use std::sync::atomic::{AtomicBool, Ordering};

use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use super::Conn;
use super::scripts::{LIBRARY, LuaScript};

/// How one server is sent the scripts: as functions until it shows it has none (an old Redis,
/// `FCALL` or `FUNCTION LOAD` renamed away or refused by the ACL), then as scripts for good.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    scripts_only: AtomicBool,
}

impl Calls {
    /// Whether the scripts are sent as functions.
    pub(crate) fn functions(&self) -> bool {
        !self.scripts_only.load(Ordering::Relaxed)
    }

    fn fall_back(&self, why: &RedisError) {
        if !self.scripts_only.swap(true, Ordering::Relaxed) {
            tracing::debug!(error = %why, "Redis functions unavailable: the lock sends EVALSHA");
        }
    }

    /// A call of `script` on `keys`; the caller appends the arguments.
    pub(crate) fn call(&self, script: &'static LuaScript, keys: &[&str], args: usize) -> Call {
        Call::new(script, self.functions(), keys, args)
    }

    /// Loads the scripts when this server runs scripts. With functions nothing is sent: the
    /// first call (`LockClient::prepare`'s probe) loads the library if it is missing and the
    /// user may, and otherwise turns this server to scripts. (Loading it here would be refused
    /// to users who may call but not load functions, and show in the ACL log, although an
    /// administrator may have loaded it.)
    pub(crate) async fn prepare<C: Conn>(
        &self,
        conn: &mut C,
        scripts: &[&LuaScript],
    ) -> Result<(), RedisError> {
        if self.functions() {
            return Ok(());
        }
        for script in scripts {
            script.script.load_async(conn).await?;
        }
        Ok(())
    }
}

/// A script call: `FCALL <function> <n> <keys>` or `EVALSHA <sha> <n> <keys>`, then the
/// arguments.
pub(crate) struct Call {
    pub(crate) cmd: Cmd,
    script: &'static LuaScript,
    function: bool,
}

impl Call {
    fn new(script: &'static LuaScript, function: bool, keys: &[&str], args: usize) -> Self {
        let mut cmd = Cmd::with_capacity(3 + keys.len() + args, 64 + 48 * (keys.len() + args));
        if function {
            cmd.arg("FCALL").arg(&script.function);
        } else {
            cmd.arg("EVALSHA").arg(script.script.get_hash());
        }
        cmd.arg(keys.len());
        for key in keys {
            cmd.arg(*key);
        }
        Call {
            cmd,
            script,
            function,
        }
    }

    /// The same call sent as `EVALSHA`.
    fn as_script(&self) -> Call {
        let mut cmd = Cmd::with_capacity(self.cmd.args_iter().len(), 64);
        cmd.arg("EVALSHA").arg(self.script.script.get_hash());
        for arg in self.cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(bytes) = arg {
                cmd.arg(bytes);
            }
        }
        Call {
            cmd,
            script: self.script,
            function: false,
        }
    }
}

/// What has been loaded while sending one call: each at most once, so a call is sent at most
/// four times (function, library loaded, as a script, script loaded) and the loop ends.
#[derive(Debug, Default)]
pub(crate) struct Recovery {
    library: bool,
    script: bool,
}

impl Recovery {
    /// Whether `call`, answered `error`, can be sent again after loading what was missing or
    /// turning it into a script; does that loading. `Err` when the loading itself failed.
    /// An error this answers `true` to means the call did not run.
    pub(crate) async fn retry<C: Conn>(
        &mut self,
        conn: &mut C,
        calls: &Calls,
        call: &mut Call,
        error: &RedisError,
    ) -> Result<bool, RedisError> {
        if call.function {
            if function_missing(error) && !self.library {
                self.library = true;
                match load_library(conn).await {
                    Ok(()) => return Ok(true),
                    Err(load) if refused_load(&load) => calls.fall_back(&load),
                    // Not loadable now (a full Redis refuses `FUNCTION LOAD`): this call as a
                    // script, the next one tries again.
                    Err(load) if is_server_answer(&load) => {}
                    Err(load) => return Err(load),
                }
            } else if refused_call(error) {
                calls.fall_back(error);
            } else if !refused_before_running(error) {
                return Ok(false);
            }
            *call = call.as_script();
            return Ok(true);
        }
        if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) && !self.script {
            self.script = true;
            call.script.script.load_async(conn).await?;
            return Ok(true);
        }
        Ok(false)
    }
}

/// Sends `call` on `conn`, loading the library or the script when the server lacks it and
/// turning it into `EVALSHA` when the server has no functions for us.
pub(crate) async fn send<C: Conn>(
    mut conn: C,
    calls: &Calls,
    mut call: Call,
) -> Result<Value, RedisError> {
    let mut recovery = Recovery::default();
    loop {
        match call.cmd.query_async::<Value>(&mut conn).await {
            // Boxed: recovering is the rare path (a new, restarted or flushed server); its
            // loading futures would otherwise grow every call's, past the size the allocator
            // serves from its per-thread cache.
            Err(error) if Box::pin(recovery.retry(&mut conn, calls, &mut call, &error)).await? => {}
            reply => return reply,
        }
    }
}

/// Loads the library. Not `REPLACE`: the library's name is the hash of its text, so one
/// already there is this one (loaded by another client, or by an administrator for users who
/// may not load functions).
async fn load_library<C: Conn>(conn: &mut C) -> Result<(), RedisError> {
    match redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(&LIBRARY.code)
        .query_async::<Value>(conn)
        .await
    {
        Err(error)
            if error
                .detail()
                .is_some_and(|d| d.to_ascii_lowercase().contains("already exists")) =>
        {
            Ok(())
        }
        other => other.map(drop),
    }
}

/// `FCALL` answered that the function is not there (a new, restarted or flushed server).
fn function_missing(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && error
            .detail()
            .is_some_and(|d| d.to_ascii_lowercase().contains("function not found"))
}

/// `FCALL` itself refused: unknown (Redis 6 says ``unknown command `FCALL` ``, Redis 7 and
/// Valkey `unknown command 'FCALL'`; a command called inside a function that the server does
/// not know is "Unknown Redis command called from script") or not allowed to this user (and not
/// a refused key or channel, which scripts would be refused too).
fn refused_call(error: &RedisError) -> bool {
    let text = error.to_string();
    if text.contains("unknown command") {
        return true;
    }
    error.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        && text.to_ascii_lowercase().contains("fcall")
}

/// `FCALL` refused before it ran because the server takes no writes at the moment, which a
/// function without flags is refused for as a whole: out of memory (`OOM`), a failed save
/// (`MISCONF`), too few replicas (`NOREPLICAS`).
fn refused_before_running(error: &RedisError) -> bool {
    matches!(error.code(), Some("OOM" | "MISCONF" | "NOREPLICAS"))
}

/// `FUNCTION LOAD` refused (unknown, renamed away, not allowed) or the library not accepted:
/// scripts are what this server can run.
fn refused_load(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::ResponseError)
    )
}

/// An error the server answered (not a connection failure or a timeout).
fn is_server_answer(error: &RedisError) -> bool {
    matches!(error.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

#[cfg(test)]
mod tests {
    use super::super::scripts::SCRIPTS;
    use super::*;

    /// `text` as the server sends it, parsed by the client.
    fn server_error(text: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).unwrap() {
            Value::ServerError(error) => error.into(),
            other => panic!("not an error: {other:?}"),
        }
    }

    #[test]
    fn a_call_sent_as_a_script_keeps_its_keys_and_arguments() {
        let mut call = Calls::default().call(&SCRIPTS.acquire, &["k", "s"], 2);
        call.cmd.arg("token").arg(10);
        let args = |c: &Call| -> Vec<Vec<u8>> {
            c.cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(b) => b.to_vec(),
                    _ => b"(not a plain argument)".to_vec(),
                })
                .collect()
        };
        assert_eq!(args(&call)[0], b"FCALL");
        let script = call.as_script();
        let (f, s) = (args(&call), args(&script));
        assert_eq!(s[0], b"EVALSHA");
        assert_eq!(s[1], SCRIPTS.acquire.script.get_hash().as_bytes());
        assert_eq!(f[2..], s[2..], "the same key count, keys and arguments");
    }

    #[test]
    fn the_refusals_that_turn_calls_into_scripts() {
        assert!(function_missing(&server_error("ERR Function not found")));
        assert!(refused_call(&server_error(
            "NOPERM this user has no permissions to run the 'fcall' command"
        )));
        assert!(refused_call(&server_error(
            "ERR unknown command 'FCALL', with args beginning with: 'x' '1' "
        )));
        // Redis 6's wording.
        assert!(refused_call(&server_error(
            "ERR unknown command `FCALL`, with args beginning with: `x`, `1`, "
        )));
        assert!(refused_call(&server_error(
            "NOPERM User locks has no permissions to run the 'fcall' command"
        )));
        assert!(!refused_call(&server_error(
            "ERR Unknown Redis command called from script script: ..."
        )));
        assert!(!refused_call(&server_error(
            "NOPERM No permissions to access a channel"
        )));
        // A refused key is the user's configuration, for scripts as for functions.
        assert!(!refused_call(&server_error(
            "NOPERM No permissions to access a key"
        )));
        assert!(!refused_call(&server_error("ERR Function not found")));
        assert!(refused_load(&server_error(
            "NOPERM this user has no permissions to run the 'function|load' command"
        )));
        assert!(!refused_load(&server_error("LOADING Redis is loading")));
        let oom = server_error("OOM command not allowed when used memory > 'maxmemory'.");
        assert!(!refused_load(&oom) && is_server_answer(&oom));
        assert!(refused_before_running(&oom));
        assert!(refused_before_running(&server_error(
            "NOREPLICAS Not enough good replicas to write."
        )));
        assert!(!refused_before_running(&server_error(
            "READONLY You can't write against a read only replica."
        )));
    }
}
