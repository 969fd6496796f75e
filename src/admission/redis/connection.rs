//! The shared limiter's connections to Redis, one of each kind per runtime: a
//! [`resp::Pipe`] for the scripts, and the `redis` crate's multiplexed connection for
//! the rest (seeding, the journal, `PING`), both on streams fleetgate opens
//! ([`RedisTarget`], TLS included). Both connect on first use, so the limiter is made
//! while Redis is down. Every call is bounded in time; any failure is
//! [`Denial::Unavailable`] and drops the connection, so the next call starts afresh.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, RedisError, RedisResult};
use tokio::runtime::{Handle, Id as RuntimeId};
use tokio::sync::OnceCell;

use super::options::RedisLimiterOptions;
use super::target::RedisTarget;
use crate::admission::Denial;
use crate::wire::resp;

/// A runtime's connection for the `redis` crate's commands: opened by its first call
/// (the others wait for it), left empty by a failed attempt.
type Shared = Arc<OnceCell<MultiplexedConnection>>;

/// The connections of one limiter (and of its journal).
pub(super) struct Connections {
    target: Arc<RedisTarget>,
    config: AsyncConnectionConfig,
    /// Where the scripts' connections ([`resp::Pipe`]) connect to.
    endpoint: Arc<resp::Endpoint>,
    /// Created on first use (they need the Tokio runtime), and replaced after a failure.
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
    made: Vec<(Option<RuntimeId>, u64, Shared)>,
    /// The same for the scripts' connections.
    pipes: Vec<(Option<RuntimeId>, u64, resp::Pipe)>,
}

impl Connections {
    /// Connections to `target`, none opened yet.
    pub(super) fn new(target: RedisTarget, options: RedisLimiterOptions) -> Self {
        let endpoint = resp::Endpoint::new(
            target.address.clone(),
            &target.settings,
            options.connect_timeout,
        );
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(options.call_timeout));
        Self {
            target: Arc::new(target),
            config,
            endpoint: Arc::new(endpoint),
            made: Mutex::new(PerRuntime::default()),
            options,
        }
    }

    /// The server the connections go to (the wake-up subscription opens its own).
    pub(super) fn target(&self) -> &Arc<RedisTarget> {
        &self.target
    }

    /// The calling runtime's connection, with its generation (for
    /// [`Connections::discard`]); opened if it is not yet.
    async fn connection(&self) -> Result<(u64, MultiplexedConnection), Denial> {
        let (generation, shared) = {
            let mut slot = self.made.lock().unwrap_or_else(|p| p.into_inner());
            let slot = &mut *slot;
            this_runtimes(&mut slot.generation, &mut slot.made, Shared::default)
        };
        let connection = shared
            .get_or_try_init(|| async {
                let bound = self.options.connect_timeout;
                let stream = match tokio::time::timeout(bound, self.target.address.connect()).await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => return Err(unavailable_because("connection", &e)),
                    Err(_) => {
                        let late = format!("no connection within {} ms", bound.as_millis());
                        return Err(unavailable_because("connection", &late));
                    }
                };
                let (connection, driver) = MultiplexedConnection::new_with_config(
                    &self.target.settings,
                    stream,
                    self.config.clone(),
                )
                .await
                .map_err(|e| unavailable("connection setup", &e))?;
                // Ends when the connection fails or its last handle is dropped.
                tokio::spawn(driver);
                Ok::<_, Denial>(connection)
            })
            .await;
        match connection {
            Ok(connection) => Ok((generation, connection.clone())),
            Err(failure) => {
                self.discard(generation);
                Err(failure)
            }
        }
    }

    /// Drops a connection that failed, so the next call starts a fresh one.
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
        this_runtimes(&mut slot.generation, &mut slot.pipes, || {
            resp::Pipe::open(Arc::clone(&self.endpoint))
        })
    }

    /// Runs one Redis call on the shared connection, bounded in time; any failure is
    /// `Unavailable`.
    pub(super) async fn call<T, F>(
        &self,
        what: &str,
        run: impl FnOnce(MultiplexedConnection) -> F,
    ) -> Result<T, Denial>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let bound = self.call_bound();
        let mut generation = None;
        let called = async {
            let (made, connection) = self.connection().await?;
            generation = Some(made);
            run(connection).await.map_err(|e| unavailable(what, &e))
        };
        let failure = match tokio::time::timeout(bound, called).await {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(failure)) => failure,
            Err(_) => Denial::Unavailable(format!(
                "redis {what}: no answer within {} ms",
                bound.as_millis()
            )),
        };
        if let Some(generation) = generation {
            self.discard(generation);
        }
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
fn this_runtimes<T: Clone>(
    generation: &mut u64,
    made: &mut Vec<(Option<RuntimeId>, u64, T)>,
    make: impl FnOnce() -> T,
) -> (u64, T) {
    let runtime = Handle::try_current().ok().map(|h| h.id());
    if let Some((_, made_in, connection)) = made.iter().find(|(r, ..)| *r == runtime) {
        return (*made_in, connection.clone());
    }
    let connection = make();
    *generation += 1;
    made.push((runtime, *generation, connection.clone()));
    (*generation, connection)
}
