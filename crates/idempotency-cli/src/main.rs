//! `idempotency`: inspect and clear the keys of `tower-idempotency` in Redis (one server or a
//! Cluster), and list executions in flight for too long. The server secret comes from the
//! environment, as the service has it: store names are keyed hashes under it.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};
use tower_idempotency::key::{self, KeySourceExt};
use tower_idempotency::operate::{Completed, InFlight, KeyState, Purge, RequestKey};
use tower_idempotency::{IdempotencyLayer, Store};

/// Inspect and clear tower-idempotency keys in Redis, and list executions in flight for too
/// long. IDEMPOTENCY_SECRET (and, during a rotation, IDEMPOTENCY_PREVIOUS_SECRETS, comma
/// separated) must be the service's.
#[derive(Debug, Parser)]
#[command(name = "idempotency", version)]
struct Cli {
    #[command(flatten)]
    store: StoreArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct StoreArgs {
    /// The Redis the service uses (redis:// or rediss://).
    #[arg(long, env = "REDIS_URL", required_unless_present = "cluster")]
    redis: Option<String>,
    /// A node of the Redis Cluster the service uses (repeat for more seeds).
    #[arg(long, conflicts_with = "redis")]
    cluster: Vec<String>,
    /// The service's key prefix.
    #[arg(long, default_value = tower_idempotency::DEFAULT_PREFIX)]
    prefix: String,
    /// The server secret.
    #[arg(long, env = "IDEMPOTENCY_SECRET", hide_env_values = true)]
    secret: String,
    /// Previous secrets still consulted during a rotation, comma separated.
    #[arg(
        long,
        env = "IDEMPOTENCY_PREVIOUS_SECRETS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    previous_secrets: Vec<String>,
    /// The service's retention (for the time an outcome was stored).
    #[arg(long, default_value = "24h", value_parser = parse_duration, global = true)]
    retention: Duration,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What the store holds for a key: executions in flight, stored outcomes.
    Inspect(KeyArgs),
    /// Delete a key's stored outcomes, so that the next request runs the handler. Executions
    /// in flight are left alone (listed): each stores its outcome when it ends.
    Purge(KeyArgs),
    /// Executions holding their lease for longer than --older-than, oldest first.
    InFlight {
        /// The age (e.g. 30s, 5m).
        #[arg(long, value_parser = parse_duration)]
        older_than: Duration,
    },
}

#[derive(Debug, Args)]
struct KeyArgs {
    /// The route template, as the router matched it (`/orders/{id}/pay`).
    #[arg(long)]
    route: String,
    /// The method.
    #[arg(long, default_value = "POST")]
    method: http::Method,
    /// The principal the key is scoped to (none: a global key).
    #[arg(long)]
    principal: Option<String>,
    /// The key names a thing (a phone number, an event id): every outcome about it.
    #[arg(long)]
    thing: bool,
    /// The key, as the request carried it.
    #[arg(long)]
    key: String,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?}: a unit is needed (ms, s, m, h, d)"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration: a number and a unit (ms, s, m, h, d)"))?;
    let unit = match unit {
        "ms" => Duration::from_millis(1),
        "s" => Duration::from_secs(1),
        "m" => Duration::from_secs(60),
        "h" => Duration::from_secs(3600),
        "d" => Duration::from_secs(86_400),
        other => return Err(format!("{text:?}: unknown unit {other:?} (ms, s, m, h, d)")),
    };
    unit.checked_mul(u32::try_from(n).map_err(|_| format!("{text:?}: too large"))?)
        .ok_or_else(|| format!("{text:?}: too large"))
}

async fn store(args: &StoreArgs) -> Result<Store, String> {
    let builder = distlock::LockClient::builder()
        .prefix(&args.prefix)
        .map_err(|e| e.to_string())?;
    let client = match &args.redis {
        Some(url) => builder.connect(url).map_err(|e| e.to_string())?,
        None => builder
            .connect_cluster(&args.cluster)
            .await
            .map_err(|e| e.to_string())?,
    };
    client.prepare().await.map_err(|e| e.to_string())?;
    Ok(Store::from_client(client))
}

/// A layer deriving names as the service's does (its secrets, the kind of its key).
fn layer(args: &StoreArgs, store: Store, thing: bool) -> Result<IdempotencyLayer, String> {
    let builder = IdempotencyLayer::builder(store)
        .secret(&args.secret)
        .and_then(|b| b.previous_secrets(&args.previous_secrets))
        .map_err(|e| e.to_string())?
        .retention(args.retention);
    let builder = if thing {
        builder.key(key::header().names_a_thing())
    } else {
        builder.global_keys()
    };
    builder.build().map_err(|e| e.to_string())
}

fn unix_ms(at: Option<SystemTime>) -> Value {
    at.and_then(|at| at.duration_since(UNIX_EPOCH).ok())
        .map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

fn in_flight_json(f: &InFlight) -> Value {
    json!({
        "name": f.name,
        "lease_left_ms": ms(f.lease_left),
        "fence": f.fence,
        "since_unix_ms": unix_ms(f.since),
    })
}

fn completed_json(c: &Completed) -> Value {
    json!({
        "name": c.name,
        "status": c.status.as_u16(),
        "body_len": c.body_len,
        "outcome_unknown": c.outcome_unknown,
        "fence": c.fence,
        "stored_at_unix_ms": unix_ms(c.stored_at),
        "expires_at_unix_ms": unix_ms(c.expires_at),
    })
}

fn age(at: Option<SystemTime>) -> String {
    at.and_then(|at| SystemTime::now().duration_since(at).ok())
        .map_or("?".into(), |d| format!("{}s ago", d.as_secs()))
}

fn print_in_flight(f: &InFlight) {
    println!(
        "in flight  {}  fence {}  since {}  lease left {}",
        &f.name,
        f.fence,
        age(f.since),
        f.lease_left
            .map_or("?".into(), |l| format!("{}ms", l.as_millis()))
    );
}

fn print_state(state: &KeyState) {
    if state.is_absent() {
        println!("absent");
    }
    for f in &state.in_flight {
        print_in_flight(f);
    }
    for c in &state.completed {
        println!(
            "completed  {}  status {}{}  body {}  stored {}  fence {}",
            c.name,
            c.status.as_u16(),
            if c.outcome_unknown {
                " (outcome unknown)"
            } else {
                ""
            },
            c.body_len
                .map_or("not kept".into(), |len| format!("{len} bytes")),
            age(c.stored_at),
            c.fence
        );
    }
}

fn print_purge(purge: &Purge) {
    println!("deleted {} outcome(s)", purge.deleted);
    for f in &purge.in_flight {
        print_in_flight(f);
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let store = store(&cli.store).await?;
    let json_out = cli.store.json;
    match cli.command {
        Command::Inspect(args) => {
            let layer = layer(&cli.store, store, args.thing)?;
            let state = layer
                .inspect(&request(&args))
                .await
                .map_err(|e| e.to_string())?;
            if json_out {
                let out = json!({
                    "in_flight": state.in_flight.iter().map(in_flight_json).collect::<Vec<_>>(),
                    "completed": state.completed.iter().map(completed_json).collect::<Vec<_>>(),
                });
                println!("{out}");
            } else {
                print_state(&state);
            }
        }
        Command::Purge(args) => {
            let layer = layer(&cli.store, store, args.thing)?;
            let purge = layer
                .purge(&request(&args))
                .await
                .map_err(|e| e.to_string())?;
            if json_out {
                let out = json!({
                    "deleted": purge.deleted,
                    "in_flight": purge.in_flight.iter().map(in_flight_json).collect::<Vec<_>>(),
                });
                println!("{out}");
            } else {
                print_purge(&purge);
            }
        }
        Command::InFlight { older_than } => {
            let layer = layer(&cli.store, store, false)?;
            let found = layer
                .in_flight(older_than)
                .await
                .map_err(|e| e.to_string())?;
            if json_out {
                let out: Vec<Value> = found.iter().map(in_flight_json).collect();
                println!("{}", Value::Array(out));
            } else {
                for f in &found {
                    print_in_flight(f);
                }
            }
        }
    }
    Ok(())
}

fn request(args: &KeyArgs) -> RequestKey {
    let key = RequestKey::new(args.method.clone(), &args.route, &args.key);
    match &args.principal {
        Some(principal) => key.principal(principal),
        None => key,
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("idempotency: {error}");
            ExitCode::FAILURE
        }
    }
}
