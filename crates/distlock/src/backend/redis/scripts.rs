//! The Lua scripts, each in its own `.lua` file, compiled into the binary and hashed once.
//!
//! `redis::Script` sends `EVALSHA` and loads the script on `NOSCRIPT`, so each script is sent in
//! full at most once per server (and again after a server restart).

use std::sync::LazyLock;

use redis::Script;

/// The lock scripts. Every script touches only keys that share one `{hash tag}`.
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) begin: Script,
    pub(crate) release: Script,
    pub(crate) extend: Script,
    pub(crate) complete: Script,
    pub(crate) append: Script,
    pub(crate) parts: Script,
    pub(crate) reentrant_acquire: Script,
    pub(crate) reentrant_release: Script,
    pub(crate) reentrant_extend: Script,
    pub(crate) fence_sync: Script,
}

impl Scripts {
    pub(crate) fn all(&self) -> [&Script; 11] {
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
        ]
    }
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: Script::new(include_str!("scripts/acquire.lua")),
    begin: Script::new(include_str!("scripts/begin.lua")),
    release: Script::new(include_str!("scripts/release.lua")),
    extend: Script::new(include_str!("scripts/extend.lua")),
    complete: Script::new(include_str!("scripts/complete.lua")),
    append: Script::new(include_str!("scripts/append.lua")),
    parts: Script::new(include_str!("scripts/parts.lua")),
    reentrant_acquire: Script::new(include_str!("scripts/reentrant_acquire.lua")),
    reentrant_release: Script::new(include_str!("scripts/reentrant_release.lua")),
    reentrant_extend: Script::new(include_str!("scripts/reentrant_extend.lua")),
    fence_sync: Script::new(include_str!("scripts/fence_sync.lua")),
});
