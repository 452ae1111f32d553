//! Shared by the benchmark harnesses: modes, statistics, and the table printer.
//!
//! Every figure is measured in rounds; within a round every variant runs once, back to back,
//! so a ratio compares variants measured under the same machine load. A figure is reported as
//! the min / median / max of its per-round values.

#![allow(dead_code, unreachable_pub)]

pub mod in_process;
#[allow(unused_imports)] // Not every harness takes percentiles.
pub use in_process::percentile_us;
pub mod ops;
pub mod peer;
pub mod profiled;

use std::time::Duration;

/// How long and how often to measure.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// Rounds per figure.
    pub rounds: usize,
    /// Measuring time per variant per round.
    pub window: Duration,
    /// Warm-up per variant per round.
    pub warmup: Duration,
    /// Whether this is a real benchmark run (`cargo bench`) or a smoke test (`cargo test`).
    pub full: bool,
}

impl Mode {
    /// `cargo bench` passes `--bench`; `cargo test` does not: then everything runs once,
    /// briefly, to prove the harness works. `BENCH_ROUNDS` and `BENCH_WINDOW_MS` override.
    pub fn from_args() -> Self {
        let full = std::env::args().any(|a| a == "--bench");
        let env = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        if full {
            Mode {
                rounds: env("BENCH_ROUNDS", 5) as usize,
                window: Duration::from_millis(env("BENCH_WINDOW_MS", 2000)),
                warmup: Duration::from_millis(300),
                full,
            }
        } else {
            Mode {
                rounds: 1,
                window: Duration::from_millis(100),
                warmup: Duration::from_millis(20),
                full,
            }
        }
    }
}

/// Values of one figure over the rounds.
#[derive(Debug, Clone, Default)]
pub struct Series(pub Vec<f64>);

impl Series {
    pub fn push(&mut self, v: f64) {
        self.0.push(v);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    }

    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    pub fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// Element-wise difference of two series measured in the same rounds.
    pub fn minus(&self, other: &Series) -> Series {
        Series(self.0.iter().zip(&other.0).map(|(a, b)| a - b).collect())
    }

    /// Element-wise ratio of two series measured in the same rounds.
    pub fn ratio(&self, other: &Series) -> Series {
        Series(self.0.iter().zip(&other.0).map(|(a, b)| a / b).collect())
    }

    pub fn fmt_ratio(&self) -> String {
        format!(
            "{:.2} / {:.2} / {:.2}",
            self.min(),
            self.median(),
            self.max()
        )
    }

    pub fn fmt_abs(&self, unit: &str) -> String {
        format!(
            "{:.0} {unit} (min {:.0}, max {:.0})",
            self.median(),
            self.min(),
            self.max()
        )
    }
}

/// Prints a markdown table row.
pub fn row(cells: &[&str]) {
    println!("| {} |", cells.join(" | "));
}

/// An HTTP/1.1 connection to `addr` (`TCP_NODELAY`), its driver spawned.
pub async fn connect<B>(addr: std::net::SocketAddr) -> hyper::client::conn::http1::SendRequest<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender
}

/// The machine, for the report header.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let redis = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    format!("{cpu}, {cores} cores; {redis}")
}
