//! A private `redis-server` on a port of its own, for the tests that stop, freeze,
//! restart or reconfigure Redis (the shared server named by TEST_REDIS_URL is left
//! alone).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a started redis-server may take to answer.
const STARTUP: Duration = Duration::from_secs(10);

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A redis-server without persistence; killed (SIGKILL) when dropped.
pub struct RedisServer(pub Child);

impl RedisServer {
    /// Starts it on `port` and waits until it answers PING.
    pub async fn start(port: u16) -> Self {
        Self::start_with(port, &[], &format!("redis://127.0.0.1:{port}")).await
    }

    /// With more arguments for redis-server; `url` reaches it once it is up.
    pub async fn start_with(port: u16, args: &[&str], url: &str) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let mut server = Self(child);
        let client = redis::Client::open(url).unwrap();
        let answered = tokio::time::timeout(STARTUP, async {
            loop {
                if let Some(status) = server.0.try_wait().unwrap() {
                    panic!("redis-server on port {port} exited at start: {status}");
                }
                let pong = async {
                    let mut connection = client.get_multiplexed_async_connection().await?;
                    redis::cmd("PING")
                        .query_async::<String>(&mut connection)
                        .await
                };
                if matches!(
                    tokio::time::timeout(Duration::from_secs(1), pong).await,
                    Ok(Ok(_))
                ) {
                    return;
                }
                // An outside process: poll until it is up.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            answered.is_ok(),
            "redis-server on port {port} answers PING within {STARTUP:?}"
        );
        server
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
