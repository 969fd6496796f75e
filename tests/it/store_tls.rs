//! The PostgreSQL store over TLS, as the docs describe it: `sslmode=verify-full` with
//! `sslrootcert` naming the CA, against a private server whose certificate a test CA
//! signed; a server signed by another CA is refused, saying so.

use sqlx::{Connection as _, PgConnection};

use crate::common::private_postgres::PrivatePostgres;
use crate::common::tls::TestCa;

#[tokio::test]
#[ignore = "needs PostgreSQL's binaries (/usr/lib/postgresql) and openssl"]
async fn the_postgres_store_connects_with_verify_full_and_refuses_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "pg-ca");
    let server = PrivatePostgres::start(&ca.server("postgres", "DNS:localhost,IP:127.0.0.1"));
    let verified = server.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        ca.cert.display()
    ));

    let store = fleetgate::store::connect(&verified).await.unwrap();
    assert!(store.list_keys().await.unwrap().is_empty(), "a fresh store");
    let mut connection = PgConnection::connect(&verified).await.unwrap();
    let (encrypted,): (bool,) =
        sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&mut connection)
            .await
            .unwrap();
    assert!(encrypted, "the connection is TLS");
    connection.close().await.unwrap();

    let other = TestCa::new(dir.path(), "other-ca");
    let untrusting = server.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        other.cert.display()
    ));
    let refused = match fleetgate::store::connect(&untrusting).await {
        Ok(_) => panic!("a server signed by another CA was trusted"),
        Err(e) => format!("{:#}", anyhow::Error::from(e)),
    };
    assert!(refused.contains("invalid peer certificate"), "{refused}");
}
