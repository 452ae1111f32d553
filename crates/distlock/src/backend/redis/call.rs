//! Sending a lock script: as `FCALL` of its function while the server has the library, as
//! `EVALSHA` once it shows it cannot (see [`scripts`](super::scripts)), loading what is missing
//! on the way.

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

    /// Loads what this server needs to run the scripts: the library, or (when functions are
    /// not available) every script.
    pub(crate) async fn prepare<C: Conn>(
        &self,
        conn: &mut C,
        scripts: &[&LuaScript],
    ) -> Result<(), RedisError> {
        if self.functions() {
            match load_library(conn).await {
                Ok(()) => return Ok(()),
                Err(error) if refused_load(&error) => self.fall_back(&error),
                Err(error) => return Err(error),
            }
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
                    Err(load) => return Err(load),
                }
            } else if refused_call(error) {
                calls.fall_back(error);
            } else {
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
            Err(error) if recovery.retry(&mut conn, calls, &mut call, &error).await? => {}
            reply => return reply,
        }
    }
}

async fn load_library<C: Conn>(conn: &mut C) -> Result<(), RedisError> {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&LIBRARY.code)
        .query_async::<Value>(conn)
        .await
        .map(drop)
}

/// `FCALL` answered that the function is not there (a new, restarted or flushed server).
fn function_missing(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && error
            .detail()
            .is_some_and(|d| d.to_ascii_lowercase().contains("function not found"))
}

/// `FCALL` itself refused: unknown (Redis 6, renamed away) or not allowed to this user.
fn refused_call(error: &RedisError) -> bool {
    let named = error
        .detail()
        .and_then(crate::refusal::quoted_command)
        .is_some_and(|c| c == "FCALL");
    let refusal = error.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        || error.to_string().contains("unknown command");
    refusal && named
}

/// `FUNCTION LOAD` refused (unknown, renamed away, not allowed) or the library not accepted:
/// an answer of the server, which scripts do without. A connection failure is not one.
fn refused_load(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(ServerErrorKind::NoPerm | ServerErrorKind::ResponseError)
    )
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
        // A refused key is the user's configuration, for scripts as for functions.
        assert!(!refused_call(&server_error(
            "NOPERM No permissions to access a key"
        )));
        assert!(!refused_call(&server_error("ERR Function not found")));
        assert!(refused_load(&server_error(
            "NOPERM this user has no permissions to run the 'function|load' command"
        )));
        assert!(!refused_load(&server_error("LOADING Redis is loading")));
    }
}
