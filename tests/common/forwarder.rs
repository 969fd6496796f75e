//! A TCP endpoint that forwards to a server it can be pointed away from: a managed
//! Redis's primary endpoint, whose name moves to the promoted replica on a failover.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Forwards each connection to the current target; stops when dropped.
pub struct Forwarder {
    address: SocketAddr,
    target: watch::Sender<SocketAddr>,
    accepting: JoinHandle<()>,
}

impl Forwarder {
    /// Listens on a free port of 127.0.0.1, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (sender, receiver) = watch::channel(target);
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, receiver.clone()));
            }
        });
        Self {
            address,
            target: sender,
            accepting,
        }
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Points new connections at `target`. Open ones stay with the old server, as they
    /// would when a DNS name moves: the client learns of the move from the server (an
    /// error, a closed connection) and reconnects.
    pub fn point_at(&self, target: SocketAddr) {
        self.target.send_replace(target);
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// One connection, to the target of the moment it was accepted.
async fn forward(mut client: TcpStream, target: watch::Receiver<SocketAddr>) {
    let target = *target.borrow();
    let Ok(mut server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
