//! The limiter over TLS (`rediss://`), against a private redis-server whose certificate
//! a test CA signed (for `localhost` only): every kind of connection (the scripts', the
//! seeding's, the wake-up subscription's) goes over TLS with the `redis_tls` settings;
//! a server it cannot trust is refused with the reason, and certificate files it cannot
//! use stop it before it starts.

use std::path::Path;

use fleetgate::admission::redis::RedisTarget;
use fleetgate::config::RedisTlsSettings;

use super::*;
use crate::common::tls::{self, TestCa};

/// A limiter on `url` with `tls`, under this file's key prefix.
fn limiter_over(
    url: &str,
    tls: &RedisTlsSettings,
    ledger: &Arc<Ledger>,
    options: RedisLimiterOptions,
) -> RedisLimiter {
    let target = RedisTarget::new(url, tls).unwrap();
    RedisLimiter::connect_to(target, "fleetgate-test:tls", ledger.clone(), options)
}

/// Why `admit` was refused: it must be `Unavailable`.
async fn refusal(limiter: &RedisLimiter) -> String {
    let admitted = timeout(
        SOON,
        limiter.admit(1, &default_limits(), &cost(1, 1, 1), "x"),
    )
    .await
    .expect("a refusal, not a hang");
    match admitted {
        Err(Denial::Unavailable(why)) => why,
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// The CA and `localhost`'s certificate, then a redis-server with them on a TLS port
/// (and a plain one); its `rediss://` URL by IP address.
async fn tls_redis(dir: &Path, auth_clients: &str) -> (TestCa, RedisServer, String, u16) {
    let ca = TestCa::new(dir, "redis-ca");
    let server = ca.server("redis", "DNS:localhost");
    let (port, tls_port) = (free_port(), free_port());
    let redis = tls::redis_server(port, tls_port, &server, &ca, auth_clients).await;
    (ca, redis, format!("rediss://127.0.0.1:{tls_port}"), port)
}

/// Trusting `ca`, and expecting the name its server certificate carries.
fn trusting(ca: &TestCa) -> RedisTlsSettings {
    RedisTlsSettings {
        ca_file: Some(ca.cert.clone()),
        server_name: Some("localhost".to_owned()),
        ..RedisTlsSettings::default()
    }
}

/// Admits, queues, wakes (through the subscription) and settles over TLS, the usage
/// counted in Redis; another CA, or the certificate's name missing, refuses every call
/// saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server (with TLS) and openssl on PATH"]
async fn the_limiter_works_over_tls_and_refuses_a_server_it_cannot_trust() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, _redis, url, plain_port) = tls_redis(dir.path(), "no").await;
    let trusted = trusting(&ca);
    let ledger = Arc::new(Ledger::default());
    let month = Month::now();
    ledger.set(1, month, 100);
    let a = limiter_over(&url, &trusted, &ledger, RedisLimiterOptions::default());
    // Only the subscription can wake b's waiter within the test.
    let slow_poll = RedisLimiterOptions {
        poll_interval: Duration::from_secs(60),
        ..RedisLimiterOptions::default()
    };
    let b = Arc::new(limiter_over(&url, &trusted, &ledger, slow_poll));
    let limits = limits(1000, 600, 1, 4);
    let each = cost(10, 1, 10);

    let first = running(a.admit(1, &limits, &each, "a").await);
    queued(b.admit(1, &limits, &each, "b").await);
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.wait_turn(1, &limits, &each, "b").await })
    };
    a.finish(1, "a", &first, 5).await.unwrap();
    let second = soon("the waiter is woken over TLS", waiter)
        .await
        .unwrap()
        .unwrap();
    b.finish(1, "b", &second, 7).await.unwrap();
    assert_eq!(a.usage(1, month).await.unwrap().used, 112);
    let mut plain = redis::Client::open(format!("redis://127.0.0.1:{plain_port}"))
        .unwrap()
        .get_connection()
        .unwrap();
    let counted: Option<u64> = redis::cmd("GET")
        .arg(a.counter_key(1, month))
        .query(&mut plain)
        .unwrap();
    assert_eq!(counted, Some(112), "the budget is counted in Redis");

    let other = TestCa::new(dir.path(), "other-ca");
    let untrusting = RedisTlsSettings {
        ca_file: Some(other.cert.clone()),
        ..trusted.clone()
    };
    let why = refusal(&limiter_over(
        &url,
        &untrusting,
        &ledger,
        RedisLimiterOptions::default(),
    ))
    .await;
    assert!(
        why.contains("TLS handshake") && why.contains("UnknownIssuer"),
        "{why}"
    );
    let by_ip_alone = RedisTlsSettings {
        server_name: None,
        ..trusted
    };
    let why = refusal(&limiter_over(
        &url,
        &by_ip_alone,
        &ledger,
        RedisLimiterOptions::default(),
    ))
    .await;
    assert!(
        why.contains("TLS handshake") && why.contains("not valid for name"),
        "{why}"
    );
}

/// A server that requires client certificates (`--tls-auth-clients yes`): refused
/// without one, served with the CA's client certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs redis-server (with TLS) and openssl on PATH"]
async fn mutual_tls_presents_the_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, _redis, url, _) = tls_redis(dir.path(), "yes").await;
    let server_only = trusting(&ca);
    let ledger = Arc::new(Ledger::default());
    let anonymous = limiter_over(&url, &server_only, &ledger, RedisLimiterOptions::default());
    refusal(&anonymous).await;

    let client = ca.client("gateway");
    let mutual = RedisTlsSettings {
        cert_file: Some(client.cert),
        key_file: Some(client.key),
        ..server_only
    };
    let limiter = limiter_over(&url, &mutual, &ledger, RedisLimiterOptions::default());
    let limits = limits(1000, 600, 1, 4);
    let grant = running(limiter.admit(1, &limits, &cost(10, 1, 10), "a").await);
    limiter.finish(1, "a", &grant, 5).await.unwrap();
    assert_eq!(limiter.usage(1, Month::now()).await.unwrap().used, 5);
}

/// Certificate files that cannot be used, and TLS settings without a `rediss://` URL,
/// stop the limiter before it is made, naming the setting and the file.
#[test]
fn unusable_tls_settings_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let error = |url: &str, tls: RedisTlsSettings| match RedisTarget::new(url, &tls) {
        Ok(_) => panic!("{url} with {tls:?} was accepted"),
        Err(e) => e.to_string(),
    };
    let url = "rediss://127.0.0.1:6380";
    let with_ca = |ca: &Path| RedisTlsSettings {
        ca_file: Some(ca.to_owned()),
        ..RedisTlsSettings::default()
    };

    let said = error(url, with_ca(&missing));
    assert!(
        said.contains("redis_tls.ca_file") && said.contains(&missing.display().to_string()),
        "{said}"
    );
    assert!(said.contains("cannot read"), "{said}");
    let said = error(url, with_ca(&not_pem));
    assert!(
        said.contains("redis_tls.ca_file") && said.contains("no certificate"),
        "{said}"
    );
    let said = error(
        url,
        RedisTlsSettings {
            cert_file: Some(not_pem.clone()),
            ..RedisTlsSettings::default()
        },
    );
    assert!(said.contains("without redis_tls.key_file"), "{said}");
    let said = error(
        url,
        RedisTlsSettings {
            cert_file: Some(not_pem.clone()),
            key_file: Some(not_pem.clone()),
            ..RedisTlsSettings::default()
        },
    );
    assert!(
        said.contains("redis_tls.cert_file") && said.contains("not.pem"),
        "{said}"
    );
    let said = error(
        url,
        RedisTlsSettings {
            server_name: Some("not a name".to_owned()),
            ..RedisTlsSettings::default()
        },
    );
    assert!(said.contains("redis_tls.server_name"), "{said}");
    let said = error("redis://127.0.0.1:6379", with_ca(&not_pem));
    assert!(said.contains("not a rediss:// URL"), "{said}");
    let said = error(
        "rediss://127.0.0.1:6380/#insecure",
        RedisTlsSettings::default(),
    );
    assert!(said.contains("#insecure"), "{said}");
    assert!(
        RedisTarget::new("rediss://127.0.0.1:6380", &RedisTlsSettings::default()).is_ok(),
        "the platform's CAs alone"
    );
}
