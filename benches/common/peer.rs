//! Peers that cannot be dependencies of the workspace, built on demand as their own packages.
//!
//! The `idempotent` crate (2.0.0) declares rust-version 1.98. As a dependency of the workspace
//! it would make every cargo command here fail on an older toolchain, benches or not. So its
//! server lives in `benches/peers/idempotent`, a package outside the workspace (its manifest
//! has its own `[workspace]` table) with its own lock file, built with `--ignore-rust-version`
//! by the cargo that runs the bench, into `<target dir>/peers`. Its server takes the same
//! `<variant> <redis_url>` arguments as the bench's own `--serve` (variants `memory` and
//! `valkey`), prints its port on the first line of stdout, and exits when stdin closes.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The peer package, relative to the workspace root.
const IDEMPOTENT_PACKAGE: &str = "benches/peers/idempotent";
/// Its binary, the `[package] name` of its manifest.
const IDEMPOTENT_BINARY: &str = "idempotent-peer";

/// Builds the `idempotent` peer's server (release, locked) and returns the path of its binary.
///
/// A no-op build after the first, which takes a few minutes from clean. The build runs with
/// `--ignore-rust-version`, since the crate's declared rust-version (1.98) may be newer than
/// the toolchain: it compiles with older ones all the same.
///
/// # Errors
///
/// A message naming the command and holding cargo's stderr if cargo cannot run or the build
/// fails, or naming the path if the binary is not where the build should have put it.
pub fn idempotent_server() -> Result<PathBuf, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(IDEMPOTENT_PACKAGE)
        .join("Cargo.toml");
    let target_dir = target_dir().join("peers");
    let mut command = Command::new(&cargo);
    command
        .args([
            "build",
            "--release",
            "--locked",
            "--quiet",
            "--ignore-rust-version",
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target_dir);
    let output = command.output().map_err(|e| {
        format!(
            "cannot run {} to build the idempotent peer: {e}",
            Path::new(&cargo).display()
        )
    })?;
    if !output.status.success() {
        return Err(format!(
            "building the idempotent peer failed ({}): {command:?}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        ));
    }
    let binary = target_dir
        .join("release")
        .join(IDEMPOTENT_BINARY)
        .with_extension(std::env::consts::EXE_EXTENSION);
    if binary.is_file() {
        Ok(binary)
    } else {
        Err(format!(
            "the idempotent peer built, but {} is missing",
            binary.display()
        ))
    }
}

/// The workspace's target directory, the one the bench itself was built in.
///
/// Cargo gives benches (and integration tests) `CARGO_TARGET_TMPDIR` at compile time:
/// `<target dir>/tmp`, wherever `CARGO_TARGET_DIR` or `--target-dir` put the target directory.
/// Without it (a build not by cargo), the bench's own path says where, as cargo lays it out:
/// `<target dir>/<profile>/deps/<name>-<hash>`.
fn target_dir() -> PathBuf {
    if let Some(tmp) = option_env!("CARGO_TARGET_TMPDIR")
        && let Some(target) = Path::new(tmp).parent()
    {
        return target.to_path_buf();
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let deps = exe.ancestors().find(|dir| dir.ends_with("deps"))?;
            Some(deps.parent()?.parent()?.to_path_buf())
        })
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}
