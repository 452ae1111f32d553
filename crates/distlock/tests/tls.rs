//! `rediss://` against real `redis-server` processes serving TLS with certificates of a CA that
//! testkit generates: one Redis, Redlock across three, mutual TLS, and the failures that must
//! be clear and quick (a CA the client does not trust, a client without the certificate the
//! server asks for, TLS settings for a plain URL).

use std::time::Duration;

use distlock::{ConfigError, LockClient, LockError, Tls};
use testkit::{RedisServer, ServerOptions, TestCa};

/// How long anything here may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, future).await {
        Ok(value) => value,
        Err(_) => panic!("waited {DEADLINE:?} for: {what}"),
    }
}

fn trusting(ca: &TestCa) -> Tls {
    Tls::new().root_certificates(ca.ca_pem()).unwrap()
}

async fn tls_server(ca: &TestCa, mutual: bool) -> RedisServer {
    RedisServer::start_with(ServerOptions::default().tls(ca, mutual)).await
}

/// Acquires, checks the fence grows, releases: the lock works over this client's connection.
async fn locks_work(client: &LockClient) {
    within("prepare over TLS", client.prepare())
        .await
        .expect("prepare over TLS");
    let lock = client.lock("tls-job").unwrap();
    let first = within("acquire", lock.try_acquire()).await.unwrap();
    let f1 = first.fence();
    assert!(within("contend", lock.try_acquire()).await.is_err(), "held");
    within("release", first.release()).await.unwrap();
    let second = within("acquire again", lock.try_acquire()).await.unwrap();
    assert!(second.fence() > f1);
    within("release", second.release()).await.unwrap();
}

fn assert_tls_config_error(result: Result<(), LockError>) -> String {
    match result {
        Err(LockError::Config(ConfigError::Invalid {
            field: "tls",
            reason,
        })) => reason,
        other => panic!("expected a TLS configuration error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_redis_over_tls() {
    let ca = TestCa::new("one").unwrap();
    let server = tls_server(&ca, false).await;
    let client = LockClient::builder()
        .prefix("tls")
        .unwrap()
        .tls(trusting(&ca))
        .connect(&server.tls_url())
        .unwrap();
    locks_work(&client).await;
    // The plain port is another listener: the TLS URL really is the TLS port.
    assert_ne!(server.tls_port(), server.port());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_the_client_does_not_trust_is_a_clear_error_not_a_hang() {
    let ca = TestCa::new("real").unwrap();
    let other = TestCa::new("other").unwrap();
    let server = tls_server(&ca, false).await;
    let client = LockClient::builder()
        .tls(trusting(&other))
        .connect(&server.tls_url())
        .unwrap();
    let reason = assert_tls_config_error(within("prepare", client.prepare()).await);
    assert!(reason.contains("certificate"), "{reason}");
    // Locks do not wait on such a connection either: an error within the command timeouts.
    let err = within("acquire", client.lock("job").unwrap().try_acquire())
        .await
        .expect_err("no lock without a trusted server");
    assert!(err.is_unavailable(), "{err:?}");

    // The system's roots do not know testkit's CA either.
    let system = LockClient::builder().connect(&server.tls_url()).unwrap();
    assert_tls_config_error(within("prepare", system.prepare()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let ca = TestCa::new("mutual").unwrap();
    let server = tls_server(&ca, true).await;
    let anonymous = LockClient::builder()
        .tls(trusting(&ca))
        .connect(&server.tls_url())
        .unwrap();
    // The server refuses a client without a certificate. (With TLS 1.3 the client learns it
    // after its side of the handshake: from the server's alert, a TLS error, or, when its
    // first command was already on the way, from the closed connection.)
    match within("prepare without a certificate", anonymous.prepare()).await {
        Err(LockError::Config(ConfigError::Invalid { field, reason })) => {
            assert_eq!(field, "tls", "{reason}");
        }
        Err(e) => assert!(e.is_unavailable(), "{e:?}"),
        Ok(()) => panic!("a client without a certificate got in"),
    }

    let identified = LockClient::builder()
        .tls(
            trusting(&ca)
                .client_identity(ca.client_cert_pem(), ca.client_key_pem())
                .unwrap(),
        )
        .connect(&server.tls_url())
        .unwrap();
    locks_work(&identified).await;

    // A certificate from another CA is refused too.
    let stranger = TestCa::new("stranger").unwrap();
    let impostor = LockClient::builder()
        .tls(
            trusting(&ca)
                .client_identity(stranger.client_cert_pem(), stranger.client_key_pem())
                .unwrap(),
        )
        .connect(&server.tls_url())
        .unwrap();
    assert!(
        within("prepare with a stranger's certificate", impostor.prepare())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_over_tls() {
    let ca = TestCa::new("redlock").unwrap();
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(tls_server(&ca, true).await);
    }
    let urls: Vec<String> = servers.iter().map(RedisServer::tls_url).collect();
    let tls = trusting(&ca)
        .client_identity(ca.client_cert_pem(), ca.client_key_pem())
        .unwrap();
    let client = LockClient::builder()
        .prefix("tls-redlock")
        .unwrap()
        .tls(tls)
        .connect_redlock(&urls)
        .unwrap();
    locks_work(&client).await;

    // Each master holds the lock while it is held: the quorum went over TLS.
    let guard = client.lock("held").unwrap().try_acquire().await.unwrap();
    for server in &servers {
        let mut conn = server.connection().await;
        let exists: bool = redis::cmd("EXISTS")
            .arg("tls-redlock:{held}")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(exists, "master {} has the lock", server.port());
    }
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_settings_for_a_plain_url_are_refused() {
    let ca = TestCa::new("plain").unwrap();
    let err = LockClient::builder()
        .tls(trusting(&ca))
        .connect("redis://127.0.0.1:6379/")
        .expect_err("TLS settings with redis://");
    assert!(err.to_string().contains("rediss://"), "{err}");
    assert!(Tls::new().root_certificates(b"garbage".to_vec()).is_err());
    assert!(
        Tls::new()
            .client_identity(ca.client_cert_pem(), b"no key".to_vec())
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_over_tls() {
    let ca = TestCa::new("cluster").unwrap();
    let cluster = testkit::RedisCluster::start_tls(3, 0, &ca).await;
    let client = within(
        "a cluster connection over TLS",
        LockClient::builder()
            .prefix("tls-cluster")
            .unwrap()
            .tls(trusting(&ca))
            .connect_cluster(&cluster.tls_urls()),
    )
    .await
    .expect("connect to the cluster over TLS");
    locks_work(&client).await;
    // Names in every slot range: each master is reached over TLS.
    for i in 0..20 {
        let guard = within(
            "acquire",
            client.lock(&format!("job-{i}")).unwrap().try_acquire(),
        )
        .await
        .unwrap();
        within("release", guard.release()).await.unwrap();
    }
    // An untrusted CA: a clear error, not a hang.
    let other = TestCa::new("cluster-other").unwrap();
    let refused = within(
        "a cluster connection with an untrusted CA",
        LockClient::builder()
            .tls(trusting(&other))
            .connect_cluster(&cluster.tls_urls()),
    )
    .await;
    assert!(
        refused.is_err(),
        "connected to a cluster it should not trust"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls() {
    let ca = TestCa::new("sentinel").unwrap();
    let group = testkit::RedisSentinel::start_tls(1, &ca).await;
    let sentinels = group.tls_sentinel_urls();
    assert_eq!(sentinels.len(), 3);
    let client = LockClient::builder()
        .prefix("tls-sentinel")
        .unwrap()
        .tls(trusting(&ca))
        .sentinel(&sentinels, testkit::SENTINEL_SERVICE)
        .unwrap();
    locks_work(&client).await;
    // The master the sentinels name is its TLS port: the lock's key is there.
    let guard = client.lock("held").unwrap().try_acquire().await.unwrap();
    let mut master = group.servers()[0].connection().await;
    let exists: bool = redis::cmd("EXISTS")
        .arg("tls-sentinel:{held}")
        .query_async(&mut master)
        .await
        .unwrap();
    assert!(exists, "the lock is on the master");
    assert_eq!(group.master_port().await, group.servers()[0].tls_port());
    guard.release().await.unwrap();
}
