//! The limiter's scripts on a lean connection of their own: every admission and every
//! settlement is one `EVALSHA` whose reply is a flat array of integers, and the `redis`
//! crate's general client (a command built twice, a parser combinator for any value, a
//! connection manager around a multiplexer) cost ~30k instructions a request for those
//! two round trips, a sixth of the gateway's own work with PostgreSQL and Redis. Here a
//! call is encoded straight into the bytes Redis reads, and a reply is read by a RESP2
//! reader that keeps integers and skips (but still frames) anything else.
//!
//! A [`Pipe`] is one connection, driven by one task on the runtime that opened it (as
//! the connection manager's were: a connection thread then never waits for another
//! thread): callers queue whole requests to it, it writes them (many at once when many
//! wait) and hands the replies back in order. A request is written whole or not at all,
//! whoever stops waiting for it, so the stream never carries half a command. The task
//! ends, and the connection closes, when the last handle is dropped (the limiter drops
//! a pipe after any failure, and opens another on the next call) or on the first I/O or
//! protocol error, which every waiting request then gets.
//!
//! Everything else (seeding, the journal, the wake-up subscription, `PING`) stays on
//! the `redis` crate: it is rare, and some of it needs other value types.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ::redis::RedisConnectionInfo;
use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::redis_stream::{Address, Stream};

/// Arrays nested deeper than this are a protocol error (no script returns any).
const MAX_DEPTH: usize = 4;

/// A Lua script, known to Redis by its SHA-1.
pub(crate) struct Script {
    code: &'static str,
    hash: String,
}

impl Script {
    pub(crate) fn new(code: &'static str) -> Self {
        let hash = ::redis::Script::new(code).get_hash().to_owned();
        Self { code, hash }
    }

    /// A call of the script, its keys and arguments to be added.
    pub(crate) fn call(&self) -> ScriptCall<'_> {
        ScriptCall {
            script: self,
            keys: 0,
            args: 0,
            key_bytes: Vec::with_capacity(256),
            arg_bytes: Vec::with_capacity(256),
        }
    }

    /// `SCRIPT LOAD`, for a Redis that does not know the script (restarted, flushed).
    pub(crate) fn load_request(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.code.len() + 64);
        out.extend_from_slice(b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n");
        bulk(&mut out, self.code.as_bytes());
        out
    }
}

/// One `EVALSHA`: the keys (`KEYS[i]` in the script), then the arguments (`ARGV[i]`).
pub(crate) struct ScriptCall<'a> {
    script: &'a Script,
    keys: usize,
    args: usize,
    key_bytes: Vec<u8>,
    arg_bytes: Vec<u8>,
}

impl ScriptCall<'_> {
    pub(crate) fn key(&mut self, key: impl Arg) -> &mut Self {
        key.write(&mut self.key_bytes);
        self.keys += 1;
        self
    }

    pub(crate) fn arg(&mut self, arg: impl Arg) -> &mut Self {
        arg.write(&mut self.arg_bytes);
        self.args += 1;
        self
    }

    pub(crate) fn script(&self) -> &Script {
        self.script
    }

    /// The request as Redis reads it.
    pub(crate) fn request(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.key_bytes.len() + self.arg_bytes.len() + 96);
        out.push(b'*');
        decimal(&mut out, (3 + self.keys + self.args) as u64);
        out.extend_from_slice(b"\r\n$7\r\nEVALSHA\r\n");
        bulk(&mut out, self.script.hash.as_bytes());
        let mut keys = itoa::Buffer::new();
        bulk(&mut out, keys.format(self.keys).as_bytes());
        out.extend_from_slice(&self.key_bytes);
        out.extend_from_slice(&self.arg_bytes);
        out
    }
}

/// A script key or argument: text, or an integer written in decimal.
pub(crate) trait Arg {
    fn write(&self, out: &mut Vec<u8>);
}

impl Arg for &str {
    fn write(&self, out: &mut Vec<u8>) {
        bulk(out, self.as_bytes());
    }
}

impl Arg for &String {
    fn write(&self, out: &mut Vec<u8>) {
        bulk(out, self.as_bytes());
    }
}

impl Arg for String {
    fn write(&self, out: &mut Vec<u8>) {
        bulk(out, self.as_bytes());
    }
}

macro_rules! integer_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn write(&self, out: &mut Vec<u8>) {
                let mut text = itoa::Buffer::new();
                bulk(out, text.format(*self).as_bytes());
            }
        }
    )*};
}
integer_arg!(u32, u64, i64);

/// `$len\r\nbytes\r\n`.
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    decimal(out, bytes.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

fn decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A reply, as far as the limiter needs it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `+…` (`OK`).
    Status,
    /// `-…`: the error text.
    Error(String),
    /// `:n`.
    Int(i64),
    /// An array of integers only (every script's reply).
    Ints(Vec<i64>),
    /// Anything else (a bulk string, a nil, an array holding more than integers).
    Other,
}

/// Reads one reply from the front of `buf`: the reply and the bytes it took, or `None`
/// while it is incomplete.
pub(crate) fn read_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>, String> {
    read_at(buf, 0, 0)
}

fn read_at(buf: &[u8], at: usize, depth: usize) -> Result<Option<(Reply, usize)>, String> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some(end) = memchr::memmem::find(&buf[at + 1..], b"\r\n").map(|i| at + 1 + i) else {
        return Ok(None);
    };
    let line = &buf[at + 1..end];
    let next = end + 2;
    let reply = match kind {
        b'+' => (Reply::Status, next),
        b'-' => (
            Reply::Error(String::from_utf8_lossy(line).into_owned()),
            next,
        ),
        b':' => (Reply::Int(integer(line)?), next),
        b'$' => match usize::try_from(integer(line)?) {
            // `$-1`: nil.
            Err(_) => (Reply::Other, next),
            Ok(len) => {
                let Some(after) = next.checked_add(len).and_then(|n| n.checked_add(2)) else {
                    return Err("a bulk string longer than memory".to_owned());
                };
                if buf.len() < after {
                    return Ok(None);
                }
                if &buf[after - 2..after] != b"\r\n" {
                    return Err("a bulk string without its line end".to_owned());
                }
                (Reply::Other, after)
            }
        },
        b'*' => {
            let Ok(count) = usize::try_from(integer(line)?) else {
                return Ok(Some((Reply::Other, next)));
            };
            if depth == MAX_DEPTH {
                return Err("arrays nested too deep".to_owned());
            }
            let mut ints = Vec::with_capacity(count.min(16));
            let mut only_ints = true;
            let mut pos = next;
            for _ in 0..count {
                let Some((item, after)) = read_at(buf, pos, depth + 1)? else {
                    return Ok(None);
                };
                pos = after;
                match item {
                    Reply::Int(n) if only_ints => ints.push(n),
                    _ => only_ints = false,
                }
            }
            let reply = if only_ints {
                Reply::Ints(ints)
            } else {
                Reply::Other
            };
            (reply, pos)
        }
        other => {
            return Err(format!(
                "a reply of unknown type {:?}",
                char::from(other).escape_default().to_string()
            ));
        }
    };
    Ok(Some(reply))
}

fn integer(line: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "a malformed integer in a reply".to_owned())
}

/// Where and how to connect: the address (and TLS), credentials and database of the
/// limiter's Redis URL (as the `redis` crate reads it).
pub(crate) struct Endpoint {
    address: Address,
    /// `AUTH` after connecting: the username (ACL) if any, and the password.
    auth: Option<(Option<String>, String)>,
    db: i64,
    connect_timeout: Duration,
}

impl Endpoint {
    pub(crate) fn new(
        address: Address,
        settings: &RedisConnectionInfo,
        connect_timeout: Duration,
    ) -> Self {
        let auth = settings
            .password()
            .map(|password| (settings.username().map(str::to_owned), password.to_owned()));
        Self {
            address,
            auth,
            db: settings.db(),
            connect_timeout,
        }
    }

    /// The handshake: `AUTH` and `SELECT` where the URL asks for them, and how many
    /// replies it gets.
    fn handshake(&self) -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        let mut replies = 0;
        if let Some((username, password)) = &self.auth {
            replies += 1;
            let parts = if username.is_some() { 3 } else { 2 };
            out.push(b'*');
            decimal(&mut out, parts);
            out.extend_from_slice(b"\r\n");
            bulk(&mut out, b"AUTH");
            if let Some(username) = username {
                bulk(&mut out, username.as_bytes());
            }
            bulk(&mut out, password.as_bytes());
        }
        if self.db != 0 {
            replies += 1;
            out.extend_from_slice(b"*2\r\n");
            bulk(&mut out, b"SELECT");
            bulk(&mut out, itoa::Buffer::new().format(self.db).as_bytes());
        }
        (out, replies)
    }
}

struct Request {
    bytes: Vec<u8>,
    reply: oneshot::Sender<Result<Reply, String>>,
}

/// A handle on one connection (see the module docs); clones share it.
#[derive(Clone)]
pub(crate) struct Pipe {
    requests: mpsc::UnboundedSender<Request>,
    connected: Arc<AtomicBool>,
    /// Why the connection ended, for a request that comes after (a failed TLS
    /// handshake can end it before the first request is queued).
    failure: Arc<OnceLock<String>>,
}

impl Pipe {
    /// Starts connecting, on the calling runtime, in the background: requests queue
    /// until the connection is up (or get its failure).
    pub(crate) fn open(endpoint: Arc<Endpoint>) -> Self {
        let (requests, queued) = mpsc::unbounded_channel();
        let connected = Arc::new(AtomicBool::new(false));
        let failure = Arc::new(OnceLock::new());
        tokio::spawn(drive(
            endpoint,
            queued,
            Arc::clone(&connected),
            Arc::clone(&failure),
        ));
        Self {
            requests,
            connected,
            failure,
        }
    }

    /// Whether the connection is up (a request then waits only for its reply).
    pub(crate) fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Sends `bytes` (one whole request) and waits for its reply. Unbounded in time: the
    /// caller bounds it.
    pub(crate) async fn request(&self, bytes: Vec<u8>) -> Result<Reply, String> {
        let (reply, replied) = oneshot::channel();
        let ended = || {
            self.failure
                .get()
                .cloned()
                .unwrap_or_else(|| "the connection closed".to_owned())
        };
        self.requests
            .send(Request { bytes, reply })
            .map_err(|_| ended())?;
        replied.await.map_err(|_| ended())?
    }
}

async fn drive(
    endpoint: Arc<Endpoint>,
    mut queued: mpsc::UnboundedReceiver<Request>,
    connected: Arc<AtomicBool>,
    ended: Arc<OnceLock<String>>,
) {
    let connection = tokio::time::timeout(endpoint.connect_timeout, connect(&endpoint));
    let failure = match connection.await {
        Err(_) => format!(
            "no connection within {} ms",
            endpoint.connect_timeout.as_millis()
        ),
        Ok(Err(failure)) => failure,
        Ok(Ok(stream)) => {
            connected.store(true, Ordering::Relaxed);
            // The plain connections split into owned halves (no lock between them).
            match stream {
                Stream::Tcp(tcp) => {
                    let (read, write) = tcp.into_split();
                    relay(read, write, &mut queued).await
                }
                Stream::Unix(unix) => {
                    let (read, write) = unix.into_split();
                    relay(read, write, &mut queued).await
                }
                tls @ Stream::Tls(_) => {
                    let (read, write) = tokio::io::split(tls);
                    relay(read, write, &mut queued).await
                }
            }
        }
    };
    connected.store(false, Ordering::Relaxed);
    let _ = ended.set(failure.clone());
    queued.close();
    while let Ok(request) = queued.try_recv() {
        let _ = request.reply.send(Err(failure.clone()));
    }
}

async fn connect(endpoint: &Endpoint) -> Result<Stream, String> {
    let mut stream = endpoint.address.connect().await?;
    let (request, expected) = endpoint.handshake();
    if expected > 0 {
        handshake(&mut stream, &request, expected).await?;
    }
    Ok(stream)
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &[u8],
    expected: usize,
) -> Result<(), String> {
    let io = |e: std::io::Error| format!("handshake: {e}");
    stream.write_all(request).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut input = BytesMut::with_capacity(256);
    let mut answered = 0;
    while answered < expected {
        if stream.read_buf(&mut input).await.map_err(io)? == 0 {
            return Err("handshake: Redis closed the connection".to_owned());
        }
        while let Some((reply, used)) = read_reply(&input)? {
            input.advance(used);
            match reply {
                Reply::Status => answered += 1,
                Reply::Error(e) => return Err(format!("handshake: {e}")),
                _ => return Err("handshake: an unexpected reply".to_owned()),
            }
        }
    }
    Ok(())
}

/// Writes the queued requests and hands back the replies, in order, until the
/// connection fails or every handle is gone; returns why it stopped, after failing the
/// requests still waiting with it.
async fn relay<R, W>(
    mut read: R,
    mut write: W,
    queued: &mut mpsc::UnboundedReceiver<Request>,
) -> String
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut waiting: VecDeque<oneshot::Sender<Result<Reply, String>>> = VecDeque::new();
    let mut input = BytesMut::with_capacity(4096);
    let mut output = Vec::with_capacity(4096);
    let failure = 'relay: loop {
        if input.capacity() - input.len() < 1024 {
            input.reserve(4096);
        }
        tokio::select! {
            biased;
            read = read.read_buf(&mut input) => {
                match read {
                    Ok(0) => break "Redis closed the connection".to_owned(),
                    Err(e) => break format!("read: {e}"),
                    Ok(_) => {}
                }
                loop {
                    match read_reply(&input) {
                        Ok(Some((reply, used))) => {
                            input.advance(used);
                            let Some(waiter) = waiting.pop_front() else {
                                break 'relay "a reply nobody asked for".to_owned();
                            };
                            // (A waiter that gave up has dropped its end: nothing to do.)
                            let _ = waiter.send(Ok(reply));
                        }
                        Ok(None) => break,
                        Err(e) => break 'relay e,
                    }
                }
            }
            request = queued.recv() => {
                let Some(request) = request else {
                    break "every handle is gone".to_owned();
                };
                output.clear();
                output.extend_from_slice(&request.bytes);
                waiting.push_back(request.reply);
                while let Ok(request) = queued.try_recv() {
                    output.extend_from_slice(&request.bytes);
                    waiting.push_back(request.reply);
                }
                // (A TLS stream may hold written bytes back until flushed; a plain
                // one's flush does nothing.)
                if let Err(e) = write.write_all(&output).await {
                    break format!("write: {e}");
                }
                if let Err(e) = write.flush().await {
                    break format!("write: {e}");
                }
            }
        }
    };
    for waiter in waiting {
        let _ = waiter.send(Err(failure.clone()));
    }
    failure
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_encoded_as_the_redis_crate_encodes_it() {
        let script = Script::new("return {KEYS[1], ARGV[1]}");
        let grants = "p:{7}:grants".to_owned();
        let mut call = script.call();
        call.key("p:{7}:run")
            .key(&grants)
            .arg(42_u64)
            .arg(u32::MAX)
            .arg(-3_i64)
            .arg("")
            .arg("a b\r\nc".to_owned());
        let expected = ::redis::cmd("EVALSHA")
            .arg(::redis::Script::new("return {KEYS[1], ARGV[1]}").get_hash())
            .arg(2)
            .arg("p:{7}:run")
            .arg(&grants)
            .arg(42_u64)
            .arg(u32::MAX)
            .arg(-3_i64)
            .arg("")
            .arg("a b\r\nc")
            .get_packed_command();
        assert_eq!(call.request(), expected);
        assert_eq!(
            script.load_request(),
            ::redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg("return {KEYS[1], ARGV[1]}")
                .get_packed_command()
        );
    }

    /// The endpoint of a plain `redis://` URL.
    fn endpoint(url: &str, connect_timeout: Duration) -> Endpoint {
        let info = ::redis::Client::open(url)
            .unwrap()
            .get_connection_info()
            .clone();
        let ::redis::ConnectionAddr::Tcp(host, port) = info.addr().clone() else {
            panic!("a TCP address")
        };
        let address = Address::Tcp {
            host,
            port,
            tls: None,
        };
        Endpoint::new(address, info.redis_settings(), connect_timeout)
    }

    #[test]
    fn the_handshake_authenticates_and_selects_as_the_url_says() {
        let endpoint = |url: &str| endpoint(url, Duration::from_secs(1));
        let plain = endpoint("redis://127.0.0.1:6379").handshake();
        assert!(plain.0.is_empty());
        assert_eq!(plain.1, 0);
        let acl = endpoint("redis://user:s3cret@127.0.0.1:6379/3").handshake();
        let mut expected = ::redis::cmd("AUTH")
            .arg("user")
            .arg("s3cret")
            .get_packed_command();
        expected.extend(::redis::cmd("SELECT").arg(3).get_packed_command());
        assert_eq!(acl.0, expected);
        assert_eq!(acl.1, 2);
        let password = endpoint("redis://:s3cret@127.0.0.1:6379").handshake();
        assert_eq!(
            password.0,
            ::redis::cmd("AUTH").arg("s3cret").get_packed_command()
        );
    }

    #[test]
    fn replies_are_read_whole_and_only_when_complete() {
        let stream: &[(&[u8], Reply)] = &[
            (
                b"*3\r\n:0\r\n:16\r\n:-41\r\n",
                Reply::Ints(vec![0, 16, -41]),
            ),
            (b"*0\r\n", Reply::Ints(vec![])),
            (b"+OK\r\n", Reply::Status),
            (
                b"-NOSCRIPT No matching script.\r\n",
                Reply::Error("NOSCRIPT No matching script.".to_owned()),
            ),
            (b":7\r\n", Reply::Int(7)),
            (b"$5\r\na\r\nbc\r\n", Reply::Other),
            (b"$-1\r\n", Reply::Other),
            (b"*-1\r\n", Reply::Other),
            (b"*2\r\n:1\r\n$1\r\nx\r\n", Reply::Other),
            (b"*2\r\n*1\r\n:1\r\n:2\r\n", Reply::Other),
        ];
        let mut all = Vec::new();
        for (bytes, _) in stream {
            all.extend_from_slice(bytes);
        }
        // Every cut of the stream: whole replies before it are read, the rest waits.
        for cut in 0..=all.len() {
            let mut at = 0;
            let mut read = 0;
            while let Some((reply, used)) = read_reply(&all[at..cut]).unwrap() {
                assert_eq!(reply, stream[read].1, "reply {read}, cut at {cut}");
                assert_eq!(used, stream[read].0.len(), "reply {read}, cut at {cut}");
                at += used;
                read += 1;
            }
            let whole = stream
                .iter()
                .scan(0, |end, (bytes, _)| {
                    *end += bytes.len();
                    Some(*end)
                })
                .take_while(|end| *end <= cut)
                .count();
            assert_eq!(read, whole, "cut at {cut}");
        }
    }

    /// A caller that stops waiting (a call timeout) while its long request is still
    /// being written: the request still goes out whole, the next one follows it intact,
    /// and the reply to the abandoned one is not handed to the next caller.
    #[tokio::test]
    async fn an_abandoned_request_is_written_whole_and_its_reply_skipped() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let pipe = Pipe::open(Arc::new(endpoint(&url, Duration::from_secs(5))));
        let (mut server, _) = listener.accept().await.unwrap();

        // Larger than the socket buffers, so its write is under way when the caller
        // gives up (the server reads nothing until then).
        let mut long = Vec::new();
        bulk(&mut long, &vec![b'x'; 16 << 20]);
        let long = [b"*1\r\n".as_slice(), &long].concat();
        let short = b"*1\r\n$4\r\nPING\r\n".to_vec();
        let given_up = tokio::time::timeout(Duration::from_millis(50), pipe.request(long.clone()));
        assert!(given_up.await.is_err(), "no reply was sent yet");
        let next = tokio::spawn({
            let pipe = pipe.clone();
            let short = short.clone();
            async move { pipe.request(short).await }
        });

        let mut received = vec![0; long.len() + short.len()];
        server.read_exact(&mut received).await.unwrap();
        assert!(
            received[..long.len()] == long[..],
            "the long request arrived whole"
        );
        assert_eq!(
            received[long.len()..],
            short[..],
            "and the next one after it"
        );
        server.write_all(b":1\r\n:2\r\n").await.unwrap();
        assert_eq!(next.await.unwrap(), Ok(Reply::Int(2)));
    }

    #[test]
    fn malformed_replies_are_errors() {
        for bad in [
            &b"?1\r\n"[..],
            b":x\r\n",
            b"*z\r\n",
            b"$3\r\nabcde\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ] {
            assert!(
                read_reply(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
