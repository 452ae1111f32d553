//! Real PostgreSQL servers for tests: `DATABASE_URL`, a local cluster made with `initdb` on a
//! free loopback port, or a container.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

use crate::{HarnessError, free_port};

const FIX: &str = "install PostgreSQL (Debian: `apt-get install -y postgresql`), set DATABASE_URL to a \
     database you own, or run a Docker engine";

/// A PostgreSQL server for one test.
///
/// [`PostgresServer::start`] takes, in order: `DATABASE_URL` if set; else Debian's (or any)
/// PostgreSQL binaries (`initdb` and `postgres` on `PATH`, in `POSTGRES_BIN_DIR`, or under
/// `/usr/lib/postgresql/*/bin`), a new cluster in a temp dir on a free loopback port (as the
/// `postgres` user when the tests run as root: PostgreSQL refuses root), stopped by its pid on
/// drop; else a `postgres:16` container when a Docker engine answers. If none works the test
/// fails with a message that says how to fix it.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// let server = testkit::PostgresServer::start().await;
/// let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls).await.unwrap();
/// tokio::spawn(connection);
/// client.batch_execute("SELECT 1").await.unwrap();
/// # }
/// ```
pub struct PostgresServer {
    url: String,
    process: Option<Process>,
    _container: Option<testcontainers::ContainerAsync<testcontainers::GenericImage>>,
}

struct Process {
    child: Mutex<Option<Child>>,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for PostgresServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresServer")
            .field("url", &self.url)
            .field("pid", &self.pid())
            .finish()
    }
}

impl PostgresServer {
    /// A server for one test. Panics (failing the test) with instructions if none can be had.
    pub async fn start() -> Self {
        match Self::try_start().await {
            Ok(server) => server,
            Err(e) => panic!("{e}"),
        }
    }

    /// One server for every test of this test binary (started by the first that asks; tests
    /// keep apart by using tables of their own: [`unique_table`](crate::unique_table)). It
    /// stops when the test binary exits: the server process is watched by a shell that stops
    /// it once its parent, the test binary, is gone.
    pub async fn shared() -> &'static PostgresServer {
        static SHARED: tokio::sync::OnceCell<PostgresServer> = tokio::sync::OnceCell::const_new();
        SHARED
            .get_or_init(|| async {
                match Self::try_start_watched().await {
                    Ok(server) => server,
                    Err(e) => panic!("{e}"),
                }
            })
            .await
    }

    async fn try_start_watched() -> Result<Self, HarnessError> {
        if std::env::var("DATABASE_URL").is_ok_and(|url| !url.is_empty()) {
            return Self::try_start().await;
        }
        let process_error = match binaries() {
            Ok(bin) => match Self::spawn(&bin, true).await {
                Ok(server) => return Ok(server),
                Err(e) => e.0,
            },
            Err(e) => e.0,
        };
        let container_error = match Self::container().await {
            Ok(server) => return Ok(server),
            Err(e) => e.0,
        };
        Err(HarnessError(format!(
            "no PostgreSQL for the tests: {process_error}; and no container: {container_error}. \
             To fix: {FIX}"
        )))
    }

    /// Like [`start`](Self::start) but returns the error.
    pub async fn try_start() -> Result<Self, HarnessError> {
        if let Ok(url) = std::env::var("DATABASE_URL")
            && !url.is_empty()
        {
            let server = PostgresServer {
                url,
                process: None,
                _container: None,
            };
            wait_ready(&server.url, None, Duration::from_secs(10)).await?;
            return Ok(server);
        }
        let process_error = match binaries() {
            Ok(bin) => match Self::spawn(&bin, false).await {
                Ok(server) => return Ok(server),
                Err(e) => e.0,
            },
            Err(e) => e.0,
        };
        let container_error = match Self::container().await {
            Ok(server) => return Ok(server),
            Err(e) => e.0,
        };
        Err(HarnessError(format!(
            "no PostgreSQL for the tests: {process_error}; and no container: {container_error}. \
             To fix: {FIX}"
        )))
    }

    /// The connection URL (`postgres://postgres@127.0.0.1:PORT/postgres`).
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The server's pid, when the test owns the process.
    pub fn pid(&self) -> Option<u32> {
        let process = self.process.as_ref()?;
        process.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// A new cluster in a temp dir; `watched`: the server runs under a shell that stops it when
    /// this process is gone.
    async fn spawn(bin: &Path, watched: bool) -> Result<Self, HarnessError> {
        let dir = tempfile::tempdir()
            .map_err(|e| HarnessError(format!("cannot create a temp dir: {e}")))?;
        let data = dir.path().join("data");
        let owner = run_as()?;
        if let Some((uid, gid)) = owner {
            rustix::fs::chown(
                dir.path(),
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
            )
            .map_err(|e| HarnessError(format!("cannot give the temp dir to postgres: {e}")))?;
        }
        let as_owner = |command: &mut Command| {
            if let Some((uid, gid)) = owner {
                use std::os::unix::process::CommandExt;
                command.uid(uid).gid(gid);
            }
        };
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdin(Stdio::null());
        as_owner(&mut initdb);
        let out = initdb
            .output()
            .map_err(|e| HarnessError(format!("cannot run initdb: {e}")))?;
        if !out.status.success() {
            return Err(HarnessError(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let mut postgres = if watched {
                // `$PPID` is this process: once it is gone, "immediate shutdown" (SIGQUIT). (By
                // /proc, not `kill -0`: the shell runs as the postgres user, this as root.)
                let mut sh = Command::new("sh");
                sh.arg("-c").arg(
                    "\"$0\" \"$@\" & server=$!; \
                     while [ -e /proc/$PPID ] && kill -0 $server 2>/dev/null; do sleep 0.5; done; \
                     kill -QUIT $server 2>/dev/null; wait $server",
                );
                sh.arg(bin.join("postgres"));
                sh
            } else {
                Command::new(bin.join("postgres"))
            };
            postgres
                .arg("-D")
                .arg(&data)
                .args(["-p", &port.to_string(), "-k"])
                .arg(dir.path())
                .args(["-c", "listen_addresses=127.0.0.1"])
                // Tests kill the application's processes, not the database: no need to wait
                // for the disk.
                .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
                .args(["-c", "full_page_writes=off", "-c", "max_connections=200"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(dir.path().join("postgres.log")).map_err(|e| {
                        HarnessError(format!("cannot create the server's log: {e}"))
                    })?,
                ));
            as_owner(&mut postgres);
            let child = postgres
                .spawn()
                .map_err(|e| HarnessError(format!("cannot run postgres: {e}")))?;
            let child = Mutex::new(Some(child));
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
            match wait_ready(&url, Some(&child), Duration::from_secs(20)).await {
                Ok(()) => {
                    return Ok(PostgresServer {
                        url,
                        process: Some(Process { child, _dir: dir }),
                        _container: None,
                    });
                }
                Err(e) => {
                    stop(child.lock().unwrap().take());
                    let log = std::fs::read_to_string(dir.path().join("postgres.log"))
                        .unwrap_or_default();
                    let tail: String = log.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                    last = format!("{e}; log: {tail}");
                }
            }
        }
        Err(HarnessError(format!("postgres would not start: {last}")))
    }

    async fn container() -> Result<Self, HarnessError> {
        use testcontainers::core::{IntoContainerPort, WaitFor};
        use testcontainers::runners::AsyncRunner;
        use testcontainers::{GenericImage, ImageExt};
        let container = GenericImage::new("postgres", "16")
            .with_exposed_port(5432.tcp())
            .with_wait_for(WaitFor::message_on_stderr(
                "database system is ready to accept connections",
            ))
            .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
            .start()
            .await
            .map_err(|e| HarnessError(format!("{e}")))?;
        let port = container
            .get_host_port_ipv4(5432)
            .await
            .map_err(|e| HarnessError(format!("{e}")))?;
        let server = PostgresServer {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            process: None,
            _container: Some(container),
        };
        wait_ready(&server.url, None, Duration::from_secs(30)).await?;
        Ok(server)
    }
}

/// Waits until the server at `url` answers a query (or `child`, its process, exits).
async fn wait_ready(
    url: &str,
    child: Option<&Mutex<Option<Child>>>,
    limit: Duration,
) -> Result<(), HarnessError> {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Some(child) = child
            && let Some(child) = child.lock().unwrap().as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            return Err(HarnessError(format!("postgres exited: {status}")));
        }
        match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                let connection = tokio::spawn(connection);
                let ready = client.batch_execute("SELECT 1").await;
                drop(client);
                let _ = connection.await;
                match ready {
                    Ok(()) => return Ok(()),
                    Err(e) => last = e.to_string(),
                }
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(HarnessError(format!(
        "{url} did not answer within {limit:?}: {last}"
    )))
}

/// Stops a server process: "immediate shutdown" (SIGQUIT), then SIGKILL if it lingers.
fn stop(child: Option<Child>) {
    let Some(mut child) = child else {
        return;
    };
    if let Some(pid) = Pid::from_raw(child.id() as i32) {
        let _ = kill_process(pid, Signal::QUIT);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(process) = &self.process {
            stop(process.child.lock().unwrap().take());
        }
    }
}

/// The directory of `initdb` and `postgres`.
fn binaries() -> Result<PathBuf, HarnessError> {
    if let Ok(dir) = std::env::var("POSTGRES_BIN_DIR")
        && !dir.is_empty()
    {
        return Ok(PathBuf::from(dir));
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .find(|dir| dir.join("initdb").is_file() && dir.join("postgres").is_file())
    });
    if let Some(dir) = on_path {
        return Ok(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        HarnessError(
            "no initdb and postgres on PATH, in POSTGRES_BIN_DIR or under /usr/lib/postgresql"
                .into(),
        )
    })
}

/// As root, the `postgres` user's uid and gid (PostgreSQL refuses to run as root).
fn run_as() -> Result<Option<(u32, u32)>, HarnessError> {
    if !rustix::process::geteuid().is_root() {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| HarnessError(format!("cannot read /etc/passwd: {e}")))?;
    passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.first() == Some(&"postgres") && fields.len() > 3)
        .and_then(|fields| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
        .map(Some)
        .ok_or_else(|| {
            HarnessError(
                "running as root, and there is no postgres user to run PostgreSQL as (Debian's \
                 postgresql package creates it)"
                    .into(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server starts, answers, and is gone once dropped.
    #[tokio::test]
    async fn a_server_starts_answers_and_stops_on_drop() {
        let server = PostgresServer::start().await;
        let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let row = client.query_one("SELECT 40 + 2", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 42);
        let pid = server.pid();
        let url = server.url();
        drop(client);
        drop(server);
        if let Some(pid) = pid {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists()
                    || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .is_ok_and(|stat| stat.contains(") Z ")),
                "postgres {pid} still runs"
            );
            assert!(
                tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .is_err()
            );
        }
    }
}
