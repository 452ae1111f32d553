//! A TCP fault proxy between a client and Redis: it forwards bytes both ways, and on request
//! delays the server's replies, holds back the replies of a connection from one that matches,
//! limits the bandwidth of each connection (a slow link), drops a reply after the command ran
//! (and cuts the connection, as a network failure would), or black-holes connections (nothing
//! passes either way, the sockets stay open). Commands always reach the server unless the
//! connection is black-holed:
//! a dropped or late reply means a command whose outcome the client cannot know.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

use crate::HarnessError;

#[derive(Debug, Default)]
struct Faults {
    /// Every reply chunk is held this long before it is forwarded.
    delay: Duration,
    /// Reply chunks still to drop; dropping one also cuts that connection.
    drop_replies: usize,
    /// Reply chunks still to forward before cutting their connection.
    cut_after: usize,
    /// Nothing is forwarded in either direction.
    blackhole: bool,
    /// A reply chunk containing these bytes, and every later one of its connection, is held
    /// back until the hold ends.
    hold: Option<Vec<u8>>,
    /// Bytes per second each connection forwards in each direction (0: no limit).
    bandwidth: u64,
}

#[derive(Debug, Default)]
struct Shared {
    faults: Mutex<Faults>,
    /// Connections accepted so far.
    accepted: AtomicUsize,
    /// Replies dropped so far.
    dropped: AtomicUsize,
    /// Connections cut right after a reply chunk so far.
    cut_after_reply: AtomicUsize,
    /// Connections accepted before this count are hung for good.
    hung_below: AtomicUsize,
    /// Fired to cut every open connection.
    cut: Notify,
    /// Fired when the faults change (a black hole ends).
    changed: Notify,
}

/// A fault proxy on a free loopback port in front of `upstream` (`host:port`). Stops (and cuts
/// every connection) when dropped.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// let server = testkit::RedisServer::start_owned().await;
/// let proxy = testkit::FaultProxy::start(&server).await;
/// proxy.delay_replies(std::time::Duration::from_millis(200)); // every reply 200 ms late
/// proxy.limit_bandwidth(4 << 20); // 4 MiB/s each way, per connection
/// proxy.drop_next_replies(1); // the next reply is lost, its connection cut
/// proxy.blackhole(true); // nothing passes, the sockets stay open
/// proxy.heal();
/// let client = redis::Client::open(proxy.url()).unwrap();
/// # drop(client);
/// # }
/// ```
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy in front of `server`.
    pub async fn start(server: &crate::RedisServer) -> Self {
        Self::to(format!("127.0.0.1:{}", server.port()))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A proxy in front of `upstream` (`host:port`).
    pub async fn to(upstream: String) -> Result<Self, HarnessError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError(format!("proxy: cannot bind a loopback port: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError(e.to_string()))?
            .port();
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(accept(listener, upstream, shared.clone()));
        Ok(FaultProxy { port, shared, task })
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL a Redis client connects to.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Holds every reply `delay` before forwarding it (commands pass at once: the server runs
    /// them on time, the client learns late). Zero ends it.
    pub fn delay_replies(&self, delay: Duration) {
        self.faults().delay = delay;
        self.shared.changed.notify_waiters();
    }

    /// Holds back the first reply that contains `needle` (a reply chunk, as read from the
    /// server), and every later reply of its connection, until [`heal`](Self::heal); replies
    /// before it and those of other connections pass, and commands still reach the server. A
    /// client then waits for the answer to a command that ran, for as long as the test wants,
    /// whatever else it sent before: `hold_replies_from(b"+OK")` holds a `SET NX` that took a
    /// key, not one that found it taken.
    ///
    /// # Panics
    /// If `needle` is empty.
    pub fn hold_replies_from(&self, needle: &[u8]) {
        assert!(!needle.is_empty(), "hold_replies_from: an empty needle");
        self.faults().hold = Some(needle.to_vec());
    }

    /// Limits every connection to `bytes_per_second` in each direction (commands and replies
    /// alike), as a slow link would: bytes are forwarded as they come, paced so that none
    /// passes sooner than the rate allows. Zero ends it.
    pub fn limit_bandwidth(&self, bytes_per_second: u64) {
        self.faults().bandwidth = bytes_per_second;
        self.shared.changed.notify_waiters();
    }

    /// Drops the next `n` replies after their commands ran, cutting each such connection.
    pub fn drop_next_replies(&self, n: usize) {
        self.faults().drop_replies = n;
    }

    /// Forwards the next `n` replies, cutting each one's connection right after it: the client
    /// got its answer, and its next command needs a new connection.
    pub fn cut_after_next_replies(&self, n: usize) {
        self.faults().cut_after = n;
    }

    /// Stops (or resumes) forwarding anything, in either direction; connections stay open, so
    /// the client sees neither an answer nor an error. New connections are accepted and
    /// black-holed too.
    pub fn blackhole(&self, on: bool) {
        self.faults().blackhole = on;
        self.shared.changed.notify_waiters();
    }

    /// Hangs every connection open now, for good: nothing passes on them any more, and they
    /// stay open (a frozen server, or a network path that drops everything, as the client
    /// sees it). New connections pass.
    pub fn hang_open_connections(&self) {
        let open = self.shared.accepted.load(Ordering::SeqCst);
        self.shared.hung_below.store(open, Ordering::SeqCst);
        self.shared.changed.notify_waiters();
    }

    /// Cuts every open connection (new ones are accepted).
    pub fn cut_all(&self) {
        self.shared.cut.notify_waiters();
    }

    /// Ends every fault.
    pub fn heal(&self) {
        *self.faults() = Faults::default();
        self.shared.changed.notify_waiters();
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Replies dropped so far.
    pub fn dropped(&self) -> usize {
        self.shared.dropped.load(Ordering::SeqCst)
    }

    /// Connections cut right after a reply chunk so far ([`cut_after_next_replies`]).
    ///
    /// [`cut_after_next_replies`]: Self::cut_after_next_replies
    pub fn cut_after_replies(&self) -> usize {
        self.shared.cut_after_reply.load(Ordering::SeqCst)
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.shared.faults.lock().unwrap()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.cut.notify_waiters();
    }
}

async fn accept(listener: TcpListener, upstream: String, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
        let upstream = upstream.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let cut = shared.cut.notified();
            tokio::pin!(cut);
            cut.as_mut().enable();
            tokio::select! {
                () = pump(client, server, shared.clone(), id) => {}
                () = cut => {}
            }
        });
    }
}

/// Forwards both ways until either side closes or a dropped reply cuts the connection.
async fn pump(client: TcpStream, server: TcpStream, shared: Arc<Shared>, id: usize) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Set when this connection is to be cut after a reply: nothing more goes to the server.
    let cutting = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // (when due, the bytes, whether the connection ends after them, whether they are held)
    let (replies, mut queued) =
        mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>, bool, bool)>();
    let commands = {
        let shared = shared.clone();
        let cutting = cutting.clone();
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            let mut pace = Pace::default();
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                pace.wait(&shared, n).await;
                wait_while_blackholed(&shared, id).await;
                if cutting.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let from_server = {
        let shared = shared.clone();
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            // This connection's replies are held (until the hold ends).
            let mut holding = false;
            loop {
                let n = match server_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let (delay, cut, held) = {
                    let mut faults = shared.faults.lock().unwrap();
                    if faults.drop_replies > 0 {
                        faults.drop_replies -= 1;
                        shared.dropped.fetch_add(1, Ordering::SeqCst);
                        // The command ran; its reply is lost with the connection.
                        return;
                    }
                    let cut = faults.cut_after > 0;
                    if cut {
                        faults.cut_after -= 1;
                        shared.cut_after_reply.fetch_add(1, Ordering::SeqCst);
                        cutting.store(true, Ordering::SeqCst);
                    }
                    holding = match &faults.hold {
                        None => false,
                        Some(needle) => {
                            holding
                                || buf[..n]
                                    .windows(needle.len())
                                    .any(|w| w == needle.as_slice())
                        }
                    };
                    (faults.delay, cut, holding)
                };
                let due = tokio::time::Instant::now() + delay;
                if replies.send((due, buf[..n].to_vec(), cut, held)).is_err() {
                    return;
                }
                if cut {
                    // The reply goes out, then the connection ends (see `to_client`).
                    std::future::pending::<()>().await;
                }
            }
        }
    };
    let to_client = {
        let shared = shared.clone();
        async move {
            let mut pace = Pace::default();
            while let Some((due, bytes, cut, held)) = queued.recv().await {
                tokio::time::sleep_until(due).await;
                if held {
                    wait_while_held(&shared).await;
                }
                pace.wait(&shared, bytes.len()).await;
                wait_while_blackholed(&shared, id).await;
                if client_write.write_all(&bytes).await.is_err() || cut {
                    let _ = client_write.flush().await;
                    return;
                }
            }
        }
    };
    tokio::select! {
        () = commands => {}
        () = from_server => {}
        () = to_client => {}
    }
}

async fn wait_while_held(shared: &Shared) {
    loop {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if shared.faults.lock().unwrap().hold.is_none() {
            return;
        }
        changed.await;
    }
}

/// The pacing of one direction of one connection under [`FaultProxy::limit_bandwidth`]: when
/// the bytes forwarded so far are due at the rate.
#[derive(Debug, Default)]
struct Pace {
    free_at: Option<tokio::time::Instant>,
}

impl Pace {
    /// Waits until `n` more bytes may pass at the current rate (at once without a limit).
    async fn wait(&mut self, shared: &Shared, n: usize) {
        let rate = shared.faults.lock().unwrap().bandwidth;
        if rate == 0 {
            self.free_at = None;
            return;
        }
        let now = tokio::time::Instant::now();
        // From where the bytes before left off, so that timer rounding (a sleep ends up to a
        // millisecond late) does not add up over a long transfer; from now after a pause.
        let start = match self.free_at {
            Some(free) if free + Duration::from_millis(5) >= now => free,
            _ => now,
        };
        let takes = Duration::from_secs_f64(n as f64 / rate as f64);
        let due = start + takes;
        self.free_at = Some(due);
        tokio::time::sleep_until(due).await;
    }
}

async fn wait_while_blackholed(shared: &Shared, id: usize) {
    loop {
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let hung = id < shared.hung_below.load(Ordering::SeqCst);
        if !hung && !shared.faults.lock().unwrap().blackhole {
            return;
        }
        changed.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn conn(proxy: &FaultProxy) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        redis::Client::open(proxy.url())
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn delays_drops_and_black_holes_replies_but_not_commands() {
        let server = crate::RedisServer::start_owned().await;
        let proxy = FaultProxy::start(&server).await;
        let mut c = conn(&proxy).await;
        let mut direct = server.connection().await;

        proxy.delay_replies(Duration::from_millis(300));
        let started = std::time::Instant::now();
        let _: () = redis::cmd("SET")
            .arg("k")
            .arg("1")
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "the reply was late"
        );
        proxy.heal();

        proxy.drop_next_replies(1);
        let lost: redis::RedisResult<()> = redis::cmd("SET")
            .arg("k")
            .arg("2")
            .query_async(&mut c)
            .await;
        assert!(lost.is_err(), "the reply was dropped");
        let value: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut direct)
            .await
            .unwrap();
        assert_eq!(value, "2", "but the command ran");
        assert_eq!(proxy.dropped(), 1);

        let mut c = conn(&proxy).await;
        proxy.blackhole(true);
        let silent = tokio::time::timeout(
            Duration::from_millis(300),
            redis::cmd("SET")
                .arg("k")
                .arg("3")
                .query_async::<()>(&mut c),
        )
        .await;
        assert!(silent.is_err(), "no answer and no error while black-holed");
        let value: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut direct)
            .await
            .unwrap();
        assert_eq!(value, "2", "and the command did not reach the server");
        proxy.heal();
        let value: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(value, "3", "held commands pass once the black hole ends");
    }

    #[tokio::test]
    async fn holds_the_replies_of_a_connection_from_the_one_that_matches() {
        let server = crate::RedisServer::start_owned().await;
        let proxy = FaultProxy::start(&server).await;
        let mut held = conn(&proxy).await;
        let mut other = conn(&proxy).await;
        let _: () = redis::cmd("SET")
            .arg("k")
            .arg("1")
            .query_async(&mut held)
            .await
            .unwrap();

        proxy.hold_replies_from(b"+OK");
        let taken: Option<String> = redis::cmd("SET")
            .arg("k")
            .arg("2")
            .arg("NX")
            .query_async(&mut held)
            .await
            .unwrap();
        assert_eq!(taken, None, "a reply without the needle passes");
        let set = tokio::spawn(async move {
            let _: () = redis::cmd("SET")
                .arg("j")
                .arg("1")
                .query_async(&mut held)
                .await
                .unwrap();
            let value: String = redis::cmd("GET")
                .arg("k")
                .query_async(&mut held)
                .await
                .unwrap();
            value
        });
        let mut direct = server.connection().await;
        let mut ran = false;
        for _ in 0..400 {
            let j: Option<String> = redis::cmd("GET")
                .arg("j")
                .query_async(&mut direct)
                .await
                .unwrap();
            if j.is_some() {
                ran = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(ran, "the command ran");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !set.is_finished(),
            "its reply is held, and the next one behind it"
        );
        let value: String = redis::cmd("GET")
            .arg("k")
            .query_async(&mut other)
            .await
            .unwrap();
        assert_eq!(value, "1", "other connections pass");
        proxy.heal();
        let value = tokio::time::timeout(Duration::from_secs(10), set)
            .await
            .expect("the held replies pass once the hold ends")
            .unwrap();
        assert_eq!(value, "1");
    }

    /// With the bandwidth limited, a large value takes its size over the rate to go through
    /// the proxy, in each direction; without the limit it passes at once.
    #[tokio::test]
    async fn a_limited_bandwidth_paces_commands_and_replies() {
        let server = crate::RedisServer::start_owned().await;
        let proxy = FaultProxy::start(&server).await;
        let mut c = conn(&proxy).await;
        let value = vec![7u8; 256 * 1024];
        let timed = |what: &'static str, took: Result<Duration, tokio::time::error::Elapsed>| {
            took.unwrap_or_else(|_| panic!("{what} did not pass within 10 s"))
        };
        proxy.limit_bandwidth(1 << 20);
        let started = std::time::Instant::now();
        let sent = tokio::time::timeout(Duration::from_secs(10), async {
            let () = redis::cmd("SET")
                .arg("big")
                .arg(&value)
                .query_async(&mut c)
                .await
                .unwrap();
            started.elapsed()
        })
        .await;
        let sent = timed("the command", sent);
        assert!(
            sent >= Duration::from_millis(240),
            "256 KiB at 1 MiB/s in {sent:?}"
        );
        let started = std::time::Instant::now();
        let read = tokio::time::timeout(Duration::from_secs(10), async {
            let read: Vec<u8> = redis::cmd("GET")
                .arg("big")
                .query_async(&mut c)
                .await
                .unwrap();
            assert_eq!(read, value);
            started.elapsed()
        })
        .await;
        let read = timed("the reply", read);
        assert!(
            read >= Duration::from_millis(240),
            "256 KiB at 1 MiB/s in {read:?}"
        );
        proxy.heal();
        let started = std::time::Instant::now();
        let read: Vec<u8> = redis::cmd("GET")
            .arg("big")
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(read.len(), value.len());
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "no limit after heal: {:?}",
            started.elapsed()
        );
    }
}
