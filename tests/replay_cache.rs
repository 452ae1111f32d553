//! The local replay cache (`Store::replay_cache`), two instances on one real Redis, over
//! sockets: a retry on the instance that ran the request is replayed without Redis; a purge
//! made on either instance, or by a third process, reaches both; a cache whose purge
//! subscription broke serves nothing until it is subscribed again.

#[macro_use]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use support::{Client, Reply, client, http, serve};
use testkit::RedisServer;
use tower_idempotency::operate::RequestKey;
use tower_idempotency::{IdempotencyLayer, ReplayCache, Store};

/// An instance of the service: its own store (and cache) on the shared Redis, its handler's
/// runs counted across instances.
struct Instance {
    store: Store,
    layer: IdempotencyLayer,
    addr: std::net::SocketAddr,
}

async fn instance(url: &str, runs: &Arc<AtomicUsize>, cached: bool) -> Instance {
    let cache = cached.then(|| {
        ReplayCache::default()
            .heartbeat(Duration::from_secs(1))
            .unwrap()
    });
    instance_with(url, runs, cache).await
}

async fn instance_with(url: &str, runs: &Arc<AtomicUsize>, cache: Option<ReplayCache>) -> Instance {
    let cached = cache.is_some();
    let mut store = Store::redis(url).unwrap();
    if let Some(cache) = cache {
        store = store.replay_cache(cache).unwrap();
    }
    store.prepare().await.expect("redis answers");
    let layer = IdempotencyLayer::builder(store.clone())
        .secret(support::SECRET)
        .unwrap()
        .global_keys()
        .build()
        .unwrap();
    let handler = {
        let runs = runs.clone();
        move |body: String| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            async move { (StatusCode::CREATED, format!("run {run}: {body}")) }
        }
    };
    let app: Router = Router::new().route("/pay", post(handler).route_layer(layer.clone()));
    let (addr, _) = serve(app).await;
    if cached {
        wait_live(&store).await;
    }
    Instance { store, layer, addr }
}

/// Waits, at most 10 s, until the cache of `store` holds `n` records (a record is cached once
/// Redis has answered its completion, which may come after the response).
async fn wait_cached(store: &Store, n: usize) {
    support::wait_until(&format!("{n} records cached"), || {
        store.replay_cache_stats().is_some_and(|s| s.entries == n)
    })
    .await;
}

/// Waits, at most 10 s, until the cache of `store` is subscribed to purges.
async fn wait_live(store: &Store) {
    support::wait_until("the replay cache subscribed to purges", || {
        store.replay_cache_stats().is_some_and(|s| s.live)
    })
    .await;
}

async fn pay(client: &Client, at: &Instance, key: &str) -> Reply {
    http(
        client,
        at.addr,
        support::post_key("/pay", key, r#"{"amount":5}"#),
    )
    .await
}

#[tokio::test]
async fn a_retry_on_the_instance_that_ran_it_is_replayed_without_redis() {
    let server = RedisServer::start_owned().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let a = instance(&server.url(), &runs, true).await;
    let b = instance(&server.url(), &runs, true).await;
    let client = client();
    let first = pay(&client, &a, "k-1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    wait_cached(&a.store, 1).await;
    let before = server.script_calls().await;
    let again = pay(&client, &a, "k-1").await;
    let after = server.script_calls().await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(
        after, before,
        "the replay on the instance that ran it asked Redis nothing"
    );
    assert_eq!(a.store.replay_cache_stats().unwrap().hits, 1);
    // The other instance has not seen it: Redis answers, with the same record.
    let elsewhere = pay(&client, &b, "k-1").await;
    assert!(elsewhere.replayed());
    assert_eq!(elsewhere.body, first.body);
    assert!(server.script_calls().await > after);
    assert_eq!(b.store.replay_cache_stats().unwrap().hits, 0);
    // Another body under the key is still refused (the record's fingerprint is checked).
    let other = http(
        &client,
        a.addr,
        support::post_key("/pay", "k-1", r#"{"amount":6}"#),
    )
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A purge reaches the cache of the instance that purged at once, and another instance's as
/// soon as Redis announces it: the next request runs the handler again on either (before: the
/// other instance replayed the purged record until its retention ended).
#[tokio::test]
async fn a_purge_reaches_every_instances_cache() {
    let server = RedisServer::start_owned().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let a = instance(&server.url(), &runs, true).await;
    let b = instance(&server.url(), &runs, true).await;
    let client = client();
    let key = RequestKey::new(http::Method::POST, "/pay", "k-2");
    assert_eq!(pay(&client, &a, "k-2").await.status, StatusCode::CREATED);
    wait_cached(&a.store, 1).await;
    // Purged on the other instance: a's cache hears of it.
    assert_eq!(b.layer.purge(&key).await.unwrap().deleted, 1);
    support::wait_until("a's cache forgot the purged record", || {
        a.store.replay_cache_stats().unwrap().entries == 0
    })
    .await;
    let rerun = pay(&client, &a, "k-2").await;
    assert!(!rerun.replayed(), "{rerun:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Purged on the instance that holds it: forgotten before purge returns.
    wait_cached(&a.store, 1).await;
    assert_eq!(a.layer.purge(&key).await.unwrap().deleted, 1);
    assert_eq!(a.store.replay_cache_stats().unwrap().entries, 0);
    assert!(!pay(&client, &a, "k-2").await.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    wait_cached(&a.store, 1).await;
    // Purged by a process without a cache (the CLI's way: the layer's purge on a plain store).
    let operator = instance(&server.url(), &runs, false).await;
    assert_eq!(operator.layer.purge(&key).await.unwrap().deleted, 1);
    support::wait_until("a's cache forgot the record the operator purged", || {
        a.store.replay_cache_stats().unwrap().entries == 0
    })
    .await;
    assert!(!pay(&client, &a, "k-2").await.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// While its purge subscription is down, a cache is empty and serves nothing (a purge then
/// would be missed); subscribed again, it caches anew.
#[tokio::test]
async fn a_cache_without_its_subscription_serves_nothing() {
    let server = RedisServer::start_owned().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let a = instance(&server.url(), &runs, true).await;
    let client = client();
    assert_eq!(pay(&client, &a, "k-3").await.status, StatusCode::CREATED);
    wait_cached(&a.store, 1).await;
    let mut conn = server.connection().await;
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(killed >= 1, "the cache's subscription was killed");
    support::wait_until("the cache emptied when its subscription broke", || {
        a.store.replay_cache_stats().unwrap().entries == 0
    })
    .await;
    wait_live(&a.store).await;
    // Replayed by Redis, not the cache; a new key is cached again.
    let before = a.store.replay_cache_stats().unwrap().hits;
    assert!(pay(&client, &a, "k-3").await.replayed());
    assert_eq!(a.store.replay_cache_stats().unwrap().hits, before);
    assert_eq!(pay(&client, &a, "k-4").await.status, StatusCode::CREATED);
    wait_cached(&a.store, 1).await;
    assert!(pay(&client, &a, "k-4").await.replayed());
    assert_eq!(a.store.replay_cache_stats().unwrap().hits, before + 1);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A cache under the least-privilege ACL user (`distlock::acl_rules`, which refuses `PING`)
/// proves its subscription with what the rules allow (a heartbeat it publishes and hears
/// back), and keeps serving: a record cached before many heartbeats is still a hit after them.
/// A Redis that stops answering (paused) stops the cache serving within two heartbeats, and it
/// serves again once heartbeats come back, emptied.
#[tokio::test]
async fn a_least_privilege_user_keeps_its_cache_and_a_paused_redis_stops_it() {
    let server = RedisServer::start_owned().await;
    let url = server
        .acl_user("idempotency", &distlock::acl_rules("idem"))
        .await;
    let runs = Arc::new(AtomicUsize::new(0));
    let heartbeat = ReplayCache::default()
        .heartbeat(Duration::from_millis(300))
        .unwrap();
    let a = instance_with(&url, &runs, Some(heartbeat)).await;
    let client = client();
    assert_eq!(pay(&client, &a, "k-5").await.status, StatusCode::CREATED);
    wait_cached(&a.store, 1).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(pay(&client, &a, "k-5").await.replayed());
    let stats = a.store.replay_cache_stats().unwrap();
    assert_eq!(
        (stats.hits, stats.entries, stats.live),
        (1, 1, true),
        "served from the cache after 5 heartbeats: {stats:?}"
    );
    server.pause().await;
    support::wait_until("a paused Redis stops the cache serving", || {
        !a.store.replay_cache_stats().unwrap().live
    })
    .await;
    server.resume().await;
    wait_live(&a.store).await;
    assert_eq!(a.store.replay_cache_stats().unwrap().entries, 0, "emptied");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The cache's bounds are checked when built, and only a store that can announce purges to it
/// takes one.
#[tokio::test]
async fn a_cache_that_cannot_work_is_refused() {
    assert!(ReplayCache::new(0, 1).is_err());
    assert!(ReplayCache::new(1, 0).is_err());
    assert!(ReplayCache::default().max_age(Duration::ZERO).is_err());
    assert!(ReplayCache::default().heartbeat(Duration::ZERO).is_err());
    let refused = Store::memory()
        .replay_cache(ReplayCache::default())
        .unwrap_err();
    assert!(refused.to_string().contains("Store::redis"), "{refused}");
}
