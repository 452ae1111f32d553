//! A model-based test of leases: random sequences of acquire (exclusive, or reentrant by one of
//! two owners), extend, release and clock advance, each with its own lease, run against a store
//! and checked against a small reference model of who may hold the lock and which fences are
//! allowed.
//!
//! The model: the key lives at least while some live hold's promise (`sent + lease` of its
//! acquisition or last renewal) lies ahead; holds of one reentrant owner share it, and the key
//! may live on until the latest promise ever made to one of them (a reentrant key's expiry
//! never shrinks; an exclusive lock's renewal may shorten it). So:
//! * while the key certainly lives, another owner's acquisition is refused, the owner's own
//!   reentrant acquisition joins with the same fence, and every hold still in it can renew and
//!   release;
//! * once it has certainly expired, any acquisition succeeds with a fence greater than every
//!   fence before, and renewals and releases of old holds fail;
//! * near a promise (within the clock's uncertainty: none on the paused Tokio clock, a few
//!   milliseconds on a real Redis) any outcome is accepted and the model follows the store.
//!
//! The in-memory store runs on paused Tokio time (thousands of steps, several seeds); Redis on
//! real time with short leases. The seed is printed on failure.

use std::time::{Duration, Instant};

use super::{Attempt, Backend, Mode, Op};
use crate::{LockName, OwnerId, Token};

#[derive(Debug, Clone)]
struct Hold {
    op: Op,
    /// `sent + lease` of the last confirmed acquisition or renewal.
    promised: Instant,
}

#[derive(Debug, Default)]
struct Model {
    holds: Vec<Hold>,
    /// The fence of the current holder.
    fence: Option<u64>,
    /// The greatest fence ever handed out.
    last_fence: u64,
    /// The latest instant the store may keep the key until.
    ceiling: Option<Instant>,
}

/// What the model knows about the key at `now`.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Key {
    Alive,
    Dead,
    Unsure,
}

impl Model {
    fn key(&self, now: Instant, margin: Duration) -> Key {
        let (Some(promised), Some(ceiling)) =
            (self.holds.iter().map(|h| h.promised).max(), self.ceiling)
        else {
            return Key::Dead;
        };
        if promised > now + margin {
            Key::Alive
        } else if ceiling.max(promised) + margin < now {
            Key::Dead
        } else {
            Key::Unsure
        }
    }

    fn promise(&mut self, i: usize, until: Instant) {
        self.holds[i].promised = until;
        self.ceiling = Some(match self.holds[i].op.mode {
            // An exclusive lock's renewal sets its expiry, shorter or longer.
            Mode::Exclusive => until,
            _ => self.ceiling.map_or(until, |c| c.max(until)),
        });
    }

    fn clear(&mut self) {
        self.holds.clear();
        self.ceiling = None;
    }

    fn owner(&self) -> Option<Option<OwnerId>> {
        self.holds.first().map(|h| match &h.op.mode {
            Mode::Reentrant { owner } => Some(owner.clone()),
            _ => None,
        })
    }
}

/// Runs `steps` random operations on `backend`. `advance` moves the clock (paused Tokio time,
/// or a real sleep); `margin` is the clock uncertainty.
async fn run<F, Fut>(
    backend: &dyn Backend,
    name: &str,
    seed: u64,
    steps: usize,
    leases_ms: &[u64],
    margin: Duration,
    advance: F,
) where
    F: Fn(Duration) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut rng = fastrand::Rng::with_seed(seed);
    let owners = [OwnerId::random(), OwnerId::random()];
    let lock = LockName::new("model", name).unwrap();
    let mut model = Model::default();
    let fail = |step: usize, what: String| -> ! {
        panic!("seed {seed}, step {step}: {what} (replay: the same seed)")
    };
    for step in 0..steps {
        let lease = Duration::from_millis(leases_ms[rng.usize(0..leases_ms.len())]);
        match rng.u8(0..10) {
            // Acquire: exclusive, or reentrant by one of the owners.
            0..=3 => {
                let mode = match rng.u8(0..3) {
                    0 => Mode::Exclusive,
                    i => Mode::Reentrant {
                        owner: owners[usize::from(i - 1)].clone(),
                    },
                };
                let op = Op {
                    name: lock.clone(),
                    token: Token::random(),
                    lease,
                    drift: Duration::from_millis(1),
                    fencing: true,
                    state_ttl: None,
                    mode: mode.clone(),
                };
                let sent = crate::clock::now();
                let key = model.key(sent, margin);
                let same_owner = match (&mode, model.owner()) {
                    (Mode::Reentrant { owner }, Some(Some(holder))) => *owner == holder,
                    _ => false,
                };
                let attempt = backend
                    .acquire(&op)
                    .await
                    .unwrap_or_else(|e| fail(step, format!("acquire: {e}")));
                match attempt {
                    Attempt::Acquired { fence } => {
                        let joined = same_owner && model.fence == Some(fence);
                        if key == Key::Alive && !same_owner {
                            fail(step, format!("{mode:?} took a lock held by another owner"));
                        }
                        if joined {
                            if key == Key::Dead {
                                fail(step, "joined holds whose lease had ended".into());
                            }
                        } else {
                            if key == Key::Alive {
                                fail(step, format!("a live hold was replaced (fence {fence})"));
                            }
                            if fence <= model.last_fence {
                                fail(step, format!("fence {fence} after {}", model.last_fence));
                            }
                            model.clear();
                            model.fence = Some(fence);
                            model.last_fence = fence;
                        }
                        model.holds.push(Hold {
                            op,
                            promised: sent + lease,
                        });
                        let last = model.holds.len() - 1;
                        model.promise(last, sent + lease);
                    }
                    Attempt::Held { .. } => {
                        if key == Key::Dead {
                            fail(step, format!("{mode:?} refused although the lock was free"));
                        }
                        if key == Key::Alive && same_owner {
                            fail(step, "the holding owner could not join its own lock".into());
                        }
                    }
                    Attempt::Done { .. } => fail(step, "a record on a plain lock".into()),
                }
            }
            // Extend one hold.
            4..=5 if !model.holds.is_empty() => {
                let i = rng.usize(0..model.holds.len());
                let sent = crate::clock::now();
                let key = model.key(sent, margin);
                let op = model.holds[i].op.clone();
                let renewed = backend
                    .extend(&op, lease)
                    .await
                    .unwrap_or_else(|e| fail(step, format!("extend: {e}")));
                match (renewed, key) {
                    (false, Key::Alive) => fail(step, "a live hold could not renew".into()),
                    (true, Key::Dead) => fail(step, "an expired hold renewed".into()),
                    (true, _) => model.promise(i, sent + lease),
                    (false, _) => model.clear(),
                }
            }
            // Release one hold.
            6..=7 if !model.holds.is_empty() => {
                let i = rng.usize(0..model.holds.len());
                let key = model.key(crate::clock::now(), margin);
                let op = model.holds[i].op.clone();
                let released = backend
                    .release(&op)
                    .await
                    .unwrap_or_else(|e| fail(step, format!("release: {e}")));
                match (released, key) {
                    (false, Key::Alive) => fail(step, "a live hold could not release".into()),
                    (true, Key::Dead) => fail(step, "an expired hold released".into()),
                    (true, _) => {
                        model.holds.remove(i);
                        if model.holds.is_empty() {
                            model.clear();
                        }
                    }
                    (false, _) => model.clear(),
                }
            }
            // Time passes.
            _ => advance(Duration::from_millis(rng.u64(0..=leases_ms[0] * 2))).await,
        }
    }
}

fn seed() -> u64 {
    std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..1_000_000))
}

#[tokio::test(start_paused = true)]
async fn leases_on_the_memory_store_follow_the_model() {
    let first = seed();
    for seed in first..first + 20 {
        let backend = super::memory::MemoryBackend::new(crate::MemoryLimits::default());
        run(
            &backend,
            "m",
            seed,
            1_000,
            &[20, 50, 100, 1_000],
            Duration::ZERO,
            tokio::time::advance,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_redis_follow_the_model() {
    let server = testkit::RedisServer::start().await;
    // Fences drawn in the acquisition script (Redlock masters, Cluster, Sentinel) and
    // pipelined behind the `SET` (one Redis).
    for pipelined in [false, true] {
        let conn = server.connection().await;
        let backend =
            super::redis::RedisBackend::new(conn, super::waiters::Waiters::local(), "redis".into())
                .with_pipelined_fences(pipelined);
        let name = testkit::unique_prefix("model");
        let probe = crate::LockName::new(&name, "prepare").unwrap();
        backend.prepare(&probe).await.unwrap();
        let seed = seed();
        // Real time: a promise counts as kept or broken only 15 ms away from it (scheduling,
        // loopback, Redis's whole milliseconds).
        run(
            &backend,
            &name,
            seed,
            150,
            &[40, 80, 160],
            Duration::from_millis(15),
            tokio::time::sleep,
        )
        .await;
    }
}
