//! The shared limiter's connections to Redis, one of each kind per runtime: a
//! [`resp::Pipe`] for the scripts, and the `redis` crate's connection manager for the
//! rest (seeding, the journal, `PING`). Both connect lazily, so the limiter is made
//! while Redis is down. Every call is bounded in time; any failure is
//! [`Denial::Unavailable`] and drops the connection, so the next call starts afresh.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, RedisError, RedisResult};
use tokio::runtime::{Handle, Id as RuntimeId};

use super::options::RedisLimiterOptions;
use crate::admission::Denial;
use crate::wire::resp;

/// The Redis URL could not be parsed (the only construction error).
#[derive(Debug, thiserror::Error)]
#[error("invalid Redis URL: {0}")]
pub struct InvalidRedisUrl(String);

/// The connections of one limiter (and of its journal).
pub(super) struct Connections {
    client: Client,
    config: ConnectionManagerConfig,
    /// Where the scripts' connections ([`resp::Pipe`]) connect to.
    endpoint: Arc<resp::Endpoint>,
    /// Created on first use (it needs the Tokio runtime); reconnects by itself, and is
    /// replaced after a failure.
    made: Mutex<PerRuntime>,
    options: RedisLimiterOptions,
}

/// One connection per runtime: a connection's replies are read by a task on the
/// runtime that made it, and each connection thread is a runtime of its own
/// (`connections/lanes.rs`), so a call from another would wait for that thread to
/// wake it, twice per round trip.
#[derive(Default)]
struct PerRuntime {
    generation: u64,
    /// The runtime, the connection's generation, the connection.
    made: Vec<(Option<RuntimeId>, u64, ConnectionManager)>,
    /// The same for the scripts' connections.
    pipes: Vec<(Option<RuntimeId>, u64, resp::Pipe)>,
}

impl Connections {
    /// Connections to the Redis at `url`, none opened yet: fails only on a malformed URL.
    pub(super) fn new(url: &str, options: RedisLimiterOptions) -> Result<Self, InvalidRedisUrl> {
        let client = Client::open(url).map_err(|e| InvalidRedisUrl(e.to_string()))?;
        let endpoint = resp::Endpoint::of(client.get_connection_info(), options.connect_timeout)
            .ok_or_else(|| InvalidRedisUrl("TLS connections are not supported".to_owned()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.call_timeout))
            // One attempt per reconnection; the next call starts another.
            .set_number_of_retries(0);
        Ok(Self {
            client,
            config,
            endpoint: Arc::new(endpoint),
            made: Mutex::new(PerRuntime::default()),
            options,
        })
    }

    /// The client the connections are made from (the wake-up subscription takes its own).
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// The calling runtime's connection, with its generation (for
    /// [`Connections::discard`]).
    fn connection(&self) -> Result<(u64, ConnectionManager), Denial> {
        let mut slot = self.made.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *slot;
        this_runtimes(&mut slot.generation, &mut slot.made, || {
            ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
                .map_err(|e| unavailable("connection setup", &e))
        })
    }

    /// Drops a connection that failed, so the next call starts a fresh one. (The manager
    /// reconnects by itself only after I/O errors; a connection attempt that failed
    /// otherwise, say on a garbled handshake, would stay failed.)
    fn discard(&self, generation: u64) {
        let mut slot = self.made.lock().unwrap_or_else(|p| p.into_inner());
        slot.made.retain(|(_, made, _)| *made != generation);
        slot.pipes.retain(|(_, made, _)| *made != generation);
    }

    /// The calling runtime's connection for scripts, with its generation; opened (in
    /// the background) on first use.
    fn pipe(&self) -> (u64, resp::Pipe) {
        let mut slot = self.made.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *slot;
        let Ok(opened) = this_runtimes(&mut slot.generation, &mut slot.pipes, || {
            Ok::<_, std::convert::Infallible>(resp::Pipe::open(Arc::clone(&self.endpoint)))
        });
        opened
    }

    /// Runs one Redis call on the shared connection, bounded in time; any failure is
    /// `Unavailable`.
    pub(super) async fn call<T, F>(
        &self,
        what: &str,
        run: impl FnOnce(ConnectionManager) -> F,
    ) -> Result<T, Denial>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let (generation, connection) = self.connection()?;
        let bound = self.call_bound();
        let failure = match tokio::time::timeout(bound, run(connection)).await {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(e)) => unavailable(what, &e),
            Err(_) => Denial::Unavailable(format!(
                "redis {what}: no answer within {} ms",
                bound.as_millis()
            )),
        };
        self.discard(generation);
        Err(failure)
    }

    /// The longest any one call may take: a connection attempt, then a script (and its
    /// reload after a Redis restart).
    fn call_bound(&self) -> Duration {
        self.options.connect_timeout + 2 * self.options.call_timeout
    }

    /// Runs a script on the calling runtime's script connection: each request bounded
    /// by the call timeout (and the connect timeout while the connection is not up yet),
    /// the script loaded and run again if Redis does not know it. Any failure is
    /// `Unavailable`, and drops the connection.
    pub(super) async fn invoke(
        &self,
        what: &str,
        call: &resp::ScriptCall<'_>,
    ) -> Result<Vec<i64>, Denial> {
        let (generation, pipe) = self.pipe();
        let outcome = match self.request(&pipe, call.request()).await {
            Ok(resp::Reply::Error(e)) if e.starts_with("NOSCRIPT") => {
                match self.request(&pipe, call.script().load_request()).await {
                    Ok(resp::Reply::Error(e)) => Err(e),
                    Ok(_) => self.request(&pipe, call.request()).await,
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        let failure = match outcome {
            Ok(resp::Reply::Ints(reply)) => return Ok(reply),
            Ok(resp::Reply::Error(e)) => e,
            Ok(_) => "an unexpected reply to a limiter script".to_owned(),
            Err(e) => e,
        };
        self.discard(generation);
        Err(unavailable_because(what, &failure))
    }

    /// One request on `pipe`, bounded in time.
    async fn request(&self, pipe: &resp::Pipe, bytes: Vec<u8>) -> Result<resp::Reply, String> {
        let mut bound = self.options.call_timeout;
        if !pipe.connected() {
            bound += self.options.connect_timeout;
        }
        match tokio::time::timeout(bound, pipe.request(bytes)).await {
            Ok(reply) => reply,
            Err(_) => Err(format!("no answer within {} ms", bound.as_millis())),
        }
    }
}

fn unavailable(what: &str, error: &RedisError) -> Denial {
    unavailable_because(what, &error.to_string())
}

/// `Unavailable`, saying what failed and why on one line.
fn unavailable_because(what: &str, why: &str) -> Denial {
    Denial::Unavailable(format!(
        "redis {what}: {}",
        why.split_whitespace().collect::<Vec<_>>().join(" ")
    ))
}

/// The calling runtime's entry of `made` (see [`PerRuntime`]), made by `make` with the
/// next generation when it has none yet.
fn this_runtimes<T: Clone, E>(
    generation: &mut u64,
    made: &mut Vec<(Option<RuntimeId>, u64, T)>,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<(u64, T), E> {
    let runtime = Handle::try_current().ok().map(|h| h.id());
    if let Some((_, made_in, connection)) = made.iter().find(|(r, ..)| *r == runtime) {
        return Ok((*made_in, connection.clone()));
    }
    let connection = make()?;
    *generation += 1;
    made.push((runtime, *generation, connection.clone()));
    Ok((*generation, connection))
}
