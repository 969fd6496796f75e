//! Connection threads ("lanes"): each is a single-threaded tokio runtime on a thread
//! of its own, and serves the client connections handed to it from their first byte to
//! their close — the connection, its requests, their upstream exchanges and
//! settlements all run on that one thread.
//!
//! Why not tokio's shared workers: with a worker per core, the worker that polls the
//! socket events readies a request's task and often wakes another worker (a `futex`)
//! to run it, and the two then wake each other again and again (on a 2-core VM, CPU per
//! request fell 5–8 % with two lanes, 15 % with one). A lane never hands a connection's
//! work to another thread, as nginx's worker processes never do; the price is that a
//! connection cannot move to an idle lane when its own is busy, so each new connection
//! goes to the lane with the fewest open.
//!
//! Everything else (start-up, the accept loop, probes, job runs, the writers) stays on
//! the process's shared runtime. The lanes are stopped when [`Lanes`] is dropped, after
//! the last settlement: a task a request spawned runs on its lane.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

/// The connection threads; dropping this stops them.
pub struct Lanes {
    lanes: Vec<Lane>,
}

struct Lane {
    handle: Handle,
    /// Connections open on this lane.
    open: Arc<AtomicUsize>,
    /// Dropped (with [`Lanes`]) to end the lane's thread.
    _stop: oneshot::Sender<()>,
}

impl Lanes {
    /// Starts `count` lanes; with `0`, connections are served by the calling runtime's
    /// workers instead.
    pub fn start(count: usize) -> io::Result<Self> {
        let lanes = (0..count).map(Lane::start).collect::<io::Result<_>>()?;
        Ok(Self { lanes })
    }

    /// Serves `tcp` with `serve` on the lane with the fewest open connections (on the
    /// calling runtime when there are no lanes), tracked by `tracker`.
    pub(super) fn serve<S, F>(&self, tracker: &TaskTracker, tcp: TcpStream, serve: S)
    where
        S: FnOnce(TcpStream) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let Some(lane) = self
            .lanes
            .iter()
            .min_by_key(|lane| lane.open.load(Ordering::Relaxed))
        else {
            tracker.spawn(serve(tcp));
            return;
        };
        // The socket leaves the accepting runtime's reactor for the lane's.
        let tcp = match tcp.into_std() {
            Ok(tcp) => tcp,
            Err(err) => {
                tracing::warn!(error = %err, "could not hand a connection to a connection thread");
                return;
            }
        };
        let open = Open::count(&lane.open);
        lane.handle.spawn(tracker.track_future(async move {
            let _open = open;
            match TcpStream::from_std(tcp) {
                Ok(tcp) => serve(tcp).await,
                Err(err) => {
                    tracing::warn!(error = %err, "could not register a connection on its connection thread");
                }
            }
        }));
    }
}

/// One connection counted open on its lane until dropped.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(open))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Lane {
    fn start(index: usize) -> io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("fleetgate-conn-{index}"))
            .spawn(move || {
                // Either a stop or the sender dropped: both end the lane. Dropping the
                // runtime then drops whatever tasks are left (idle pooled connections).
                let _ = runtime.block_on(stopped);
            })?;
        Ok(Self {
            handle,
            open: Arc::new(AtomicUsize::new(0)),
            _stop: stop,
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// Connections handed to lanes; each reports the thread serving it, then stays
    /// open until its token is cancelled.
    struct Bench {
        listener: TcpListener,
        seen: mpsc::UnboundedSender<String>,
        served_on: mpsc::UnboundedReceiver<String>,
        clients: Vec<tokio::net::TcpStream>,
    }

    /// One connection served: the thread serving it, and its end.
    struct Served {
        thread: String,
        end: CancellationToken,
        tracker: TaskTracker,
    }

    impl Served {
        /// Ends the connection and waits until it is over.
        async fn close(self) {
            self.end.cancel();
            self.tracker.close();
            self.tracker.wait().await;
        }
    }

    impl Bench {
        async fn new() -> Self {
            let (seen, served_on) = mpsc::unbounded_channel();
            Self {
                listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
                seen,
                served_on,
                clients: Vec::new(),
            }
        }

        async fn open(&mut self, lanes: &Lanes) -> Served {
            let address = self.listener.local_addr().unwrap();
            self.clients
                .push(tokio::net::TcpStream::connect(address).await.unwrap());
            let (tcp, _) = self.listener.accept().await.unwrap();
            let (seen, end, tracker) = (
                self.seen.clone(),
                CancellationToken::new(),
                TaskTracker::new(),
            );
            let ends = end.clone();
            lanes.serve(&tracker, tcp, move |_tcp| async move {
                let name = std::thread::current().name().unwrap_or("").to_owned();
                seen.send(name).unwrap();
                ends.cancelled().await;
            });
            let thread = self.served_on.recv().await.unwrap();
            Served {
                thread,
                end,
                tracker,
            }
        }
    }

    #[tokio::test]
    async fn each_connection_goes_to_the_lane_with_the_fewest_open() {
        let lanes = Lanes::start(2).unwrap();
        let mut bench = Bench::new().await;
        let a = bench.open(&lanes).await;
        let b = bench.open(&lanes).await;
        assert!(a.thread.starts_with("fleetgate-conn-"), "{}", a.thread);
        assert_ne!(a.thread, b.thread, "the second goes to the idle lane");
        let c = bench.open(&lanes).await;
        assert_eq!(c.thread, a.thread, "a tie goes to the first lane");
        let first_lane = a.thread.clone();
        // The first lane is down to one connection, as the second is.
        a.close().await;
        let d = bench.open(&lanes).await;
        assert_eq!(d.thread, first_lane);
        let e = bench.open(&lanes).await;
        assert_eq!(e.thread, b.thread);
        for served in [b, c, d, e] {
            served.close().await;
        }
    }

    #[tokio::test]
    async fn without_lanes_connections_are_served_on_the_calling_runtime() {
        let lanes = Lanes::start(0).unwrap();
        let mut bench = Bench::new().await;
        let here = std::thread::current().name().unwrap_or("").to_owned();
        let served = bench.open(&lanes).await;
        assert_eq!(served.thread, here);
        served.close().await;
    }
}
