//! The Lua scripts, each in its own `.lua` file, compiled into the binary, hashed once, and
//! sent to Redis in one of two ways:
//!
//! * as **functions** (`FCALL`, Redis 7+ and Valkey): every script is registered, body
//!   unchanged, as a function of one library ([`LIBRARY`]), loaded with `FUNCTION LOAD` when the
//!   server answers that a function is missing. A call costs Redis less than `EVALSHA` of the
//!   same script (measured in `benches/lock.rs`, docs/BENCHMARKS.md, "The lock"), and a library
//!   lives in the dataset (replicated, persisted) rather than in a cache;
//! * as **scripts** (`EVALSHA`), where the server has no functions (Redis 6), renamed them
//!   away, or the ACL user may not call or load them: `redis::Script` sends `EVALSHA` and the
//!   script is loaded on `NOSCRIPT`.
//!
//! The library and its functions are named after the SHA-1 of the library's text, so two
//! versions of this crate on one server each call their own.

use std::sync::LazyLock;

use redis::Script;

/// One lock script: its `EVALSHA` form, and the name of the function it is in [`LIBRARY`].
pub(crate) struct LuaScript {
    pub(crate) script: Script,
    pub(crate) function: String,
}

/// The lock scripts. Every script touches only keys that share one `{hash tag}`.
pub(crate) struct Scripts {
    pub(crate) acquire: LuaScript,
    pub(crate) begin: LuaScript,
    pub(crate) release: LuaScript,
    pub(crate) extend: LuaScript,
    pub(crate) complete: LuaScript,
    pub(crate) append: LuaScript,
    pub(crate) parts: LuaScript,
    pub(crate) reentrant_acquire: LuaScript,
    pub(crate) reentrant_release: LuaScript,
    pub(crate) reentrant_extend: LuaScript,
    pub(crate) fence_sync: LuaScript,
    pub(crate) record: LuaScript,
    pub(crate) check: LuaScript,
    pub(crate) inspect: LuaScript,
    pub(crate) purge: LuaScript,
}

impl Scripts {
    pub(crate) fn all(&self) -> [&LuaScript; 15] {
        [
            &self.acquire,
            &self.begin,
            &self.release,
            &self.extend,
            &self.complete,
            &self.append,
            &self.parts,
            &self.reentrant_acquire,
            &self.reentrant_release,
            &self.reentrant_extend,
            &self.fence_sync,
            &self.record,
            &self.check,
            &self.inspect,
            &self.purge,
        ]
    }
}

/// The scripts' sources: name, text, and the flags of its function.
///
/// A function without flags is refused as a whole while the server is out of memory, where the
/// same script sent with `EVALSHA` runs and only its memory-growing commands are refused. The
/// scripts that only free or renew (release, renewal) are flagged `allow-oom` so that a lock
/// can still be released and kept while Redis is full, as before; the read-only ones are
/// `no-writes`. The others keep the default: refused whole, before they touch anything.
const SOURCES: [(&str, &str, &str); 15] = [
    ("acquire", include_str!("scripts/acquire.lua"), ""),
    ("begin", include_str!("scripts/begin.lua"), ""),
    ("release", include_str!("scripts/release.lua"), "allow-oom"),
    ("extend", include_str!("scripts/extend.lua"), "allow-oom"),
    ("complete", include_str!("scripts/complete.lua"), ""),
    ("append", include_str!("scripts/append.lua"), ""),
    ("parts", include_str!("scripts/parts.lua"), "no-writes"),
    (
        "reentrant_acquire",
        include_str!("scripts/reentrant_acquire.lua"),
        "",
    ),
    (
        "reentrant_release",
        include_str!("scripts/reentrant_release.lua"),
        "allow-oom",
    ),
    (
        "reentrant_extend",
        include_str!("scripts/reentrant_extend.lua"),
        "allow-oom",
    ),
    ("fence_sync", include_str!("scripts/fence_sync.lua"), ""),
    ("record", include_str!("scripts/record.lua"), "no-writes"),
    ("check", include_str!("scripts/check.lua"), "no-writes"),
    ("inspect", include_str!("scripts/inspect.lua"), "no-writes"),
    // Frees memory: a purge must work on a full server.
    ("purge", include_str!("scripts/purge.lua"), "allow-oom"),
];

/// The function library: its name and its text (what `FUNCTION LOAD` is sent).
pub(crate) struct Library {
    pub(crate) name: String,
    pub(crate) code: String,
}

/// The library holding every script as a function, named `distlock_<hash>`; each function is
/// `distlock_<hash>_<script>`, called with the script's `KEYS` and `ARGV` as its arguments.
pub(crate) static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    let body: String = SOURCES
        .iter()
        .map(|(name, text, flags)| {
            let flags = if flags.is_empty() {
                String::new()
            } else {
                format!(", flags = {{'{flags}'}}")
            };
            format!(
                "redis.register_function{{function_name = 'distlock_@_{name}', callback = \
                 function(KEYS, ARGV)\n{text}\nend{flags}}}\n"
            )
        })
        .collect();
    let hash = Script::new(&body);
    let tag = format!("distlock_{}", &hash.get_hash()[..16]);
    Library {
        code: format!(
            "#!lua name={tag}\n{}",
            body.replace("distlock_@_", &format!("{tag}_"))
        ),
        name: tag,
    }
});

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let [
        acquire,
        begin,
        release,
        extend,
        complete,
        append,
        parts,
        reentrant_acquire,
        reentrant_release,
        reentrant_extend,
        fence_sync,
        record,
        check,
        inspect,
        purge,
    ] = SOURCES.map(|(name, text, _)| LuaScript {
        script: Script::new(text),
        function: format!("{}_{name}", LIBRARY.name),
    });
    Scripts {
        acquire,
        begin,
        release,
        extend,
        complete,
        append,
        parts,
        reentrant_acquire,
        reentrant_release,
        reentrant_extend,
        fence_sync,
        record,
        check,
        inspect,
        purge,
    }
});

#[cfg(test)]
mod tests {
    use super::{LIBRARY, SCRIPTS};

    #[test]
    fn every_script_is_a_function_of_the_library() {
        assert!(
            LIBRARY
                .code
                .starts_with(&format!("#!lua name={}\n", LIBRARY.name))
        );
        for script in SCRIPTS.all() {
            let registered = format!("function_name = '{}'", script.function);
            assert_eq!(
                LIBRARY.code.matches(&registered).count(),
                1,
                "{} registered once",
                script.function
            );
            assert!(
                script
                    .function
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "a valid function name: {}",
                script.function
            );
        }
        assert!(!LIBRARY.code.contains('@'), "every name filled in");
    }
}
