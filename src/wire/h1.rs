//! A small HTTP/1.1 client for the hot call, `POST /v1/completions` to an `http://`
//! node. The request, its answer and the answer's body are all read and written by the
//! caller's own task, and the body yields every chunk already read without waiting
//! again.
//!
//! Why not reqwest here: hyper's client runs each connection in a task of its own and
//! hands a response body over a channel one chunk at a time, so a stream of N SSE
//! frames (one HTTP chunk each, as vLLM sends them) costs 2N task wake-ups, and the
//! relay can never see more than one frame at a time to write in one go. Everything
//! else (probes, tokenization, hooks, `https://` nodes, URLs with user info or a
//! query) stays on reqwest.
//!
//! What it does: a keep-alive pool per host (idle connections closed after the idle
//! timeout, at most [`MAX_IDLE_PER_HOST`] kept, each reused only on the runtime that
//! made it), `Content-Length`, chunked and close-delimited bodies, and a request whose
//! reused connection turns out closed before any answer retried once on a new
//! connection (the node closed it while idle; hyper does the same). What it leaves out,
//! since vLLM needs none of it: redirects, proxies, compression, TLS, trailers (read and
//! dropped).

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write as _};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, StatusCode};
use rustc_hash::FxHashMap;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::runtime::Id as RuntimeId;

/// A response head longer than this is refused.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 64;
/// A chunk-size or trailer line longer than this is refused.
const MAX_LINE: usize = 4096;
/// Idle connections kept per host; more are closed when returned.
const MAX_IDLE_PER_HOST: usize = 256;
/// The read buffer's size: a new one is made when less than [`READ_MIN`] of it is left.
const READ_SIZE: usize = 16 * 1024;
/// The least room a read is given. Each piece of a body is split off the read buffer and
/// relayed as it is, keeping the buffer's memory until written; so a buffer made anew
/// before every read would be an allocation per SSE frame of a paced stream, where
/// reads fill the room left after the frames before them, ~40 frames to a buffer.
const READ_MIN: usize = 4 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    #[error("connect failed: {0}")]
    Connect(#[source] io::Error),
    #[error("{0}")]
    Io(#[source] io::Error),
    #[error("the connection closed before an answer")]
    Closed,
    #[error("malformed answer: {0}")]
    Malformed(&'static str),
}

/// The pool of connections, shared by clones.
#[derive(Clone)]
pub struct Client {
    pool: Arc<Pool>,
}

struct Pool {
    idle: Mutex<FxHashMap<String, VecDeque<Idle>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

struct Idle {
    stream: TcpStream,
    since: Instant,
    runtime: Option<RuntimeId>,
}

/// Where a connection takes a pooled one from and returns it to (see [`runtime`]).
struct Home {
    pool: Arc<Pool>,
    authority: String,
    runtime: Option<RuntimeId>,
}

/// The runtime whose reactor a socket made now is registered with. A pooled connection
/// is only reused on that runtime: each connection thread (`connections/lanes.rs`) is a
/// runtime of its own, and a socket registered with another's reactor would have its
/// readiness delivered by that thread, a wake-up between threads for every read.
fn runtime() -> Option<RuntimeId> {
    tokio::runtime::Handle::try_current().ok().map(|h| h.id())
}

impl Home {
    /// Returns a connection whose answer was read to its end to the pool.
    fn checkin(self, stream: TcpStream) {
        let mut idle = self.pool.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.entry(self.authority).or_default();
        // The oldest are at the front.
        while list
            .front()
            .is_some_and(|c| c.since.elapsed() >= self.pool.idle_timeout)
        {
            list.pop_front();
        }
        if list.len() >= MAX_IDLE_PER_HOST {
            list.pop_front();
        }
        list.push_back(Idle {
            stream,
            since: Instant::now(),
            runtime: self.runtime,
        });
    }
}

/// An `http://host[:port][/base]` URL this client can reach, split for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    /// `host:port` or `host` (port 80), also the `Host` header.
    authority: &'a str,
    /// The path the node is mounted under, without a trailing slash; often empty.
    base: &'a str,
}

impl<'a> Target<'a> {
    /// `None` for anything but a plain `http://` URL (those go through reqwest).
    pub fn parse(url: &'a str) -> Option<Self> {
        let rest = url.strip_prefix("http://")?;
        let (authority, base) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
        let plain = |s: &str| !s.contains(['@', '?', '#', ' ']) && !s.is_empty();
        if !plain(authority) || base.contains(['?', '#', ' ']) {
            return None;
        }
        Some(Self {
            authority,
            base: base.trim_end_matches('/'),
        })
    }

    /// The address to connect to: the authority, with port 80 when it names none.
    fn address(&self) -> String {
        let has_port = match self.authority.rsplit_once(':') {
            // `[::1]` has colons but no port.
            Some((host, port)) => !port.is_empty() && (!host.contains(':') || host.ends_with(']')),
            None => false,
        };
        if has_port {
            self.authority.to_owned()
        } else {
            format!("{}:80", self.authority)
        }
    }
}

impl Client {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self {
            pool: Arc::new(Pool {
                idle: Mutex::new(FxHashMap::default()),
                connect_timeout,
                idle_timeout,
            }),
        }
    }

    /// Sends `POST {base}{path}` with a JSON body and `headers` besides its own, and
    /// reads the answer's head; the body is left to the caller.
    pub async fn post_json(
        &self,
        target: Target<'_>,
        path: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Response, Error> {
        // One allocation: the fixed text and the length's digits fit in the 128.
        let extra: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum();
        let mut head = Vec::with_capacity(
            128 + target.base.len() + path.len() + target.authority.len() + extra,
        );
        write!(
            head,
            "POST {}{path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            target.base,
            target.authority,
            body.len()
        )
        .map_err(Error::Io)?;
        for (name, value) in headers {
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        let runtime = runtime();
        if let Some(stream) = self.pool.checkout(target.authority, runtime) {
            match exchange(stream, &head, body).await {
                Ok(answer) => return Ok(self.response(target, answer, runtime)),
                // Closed by the node while it sat idle: once more on a new connection.
                Err(Error::Closed | Error::Io(_)) => {}
                Err(err) => return Err(err),
            }
        }
        let stream = self.connect(target).await?;
        let answer = exchange(stream, &head, body).await?;
        Ok(self.response(target, answer, runtime))
    }

    async fn connect(&self, target: Target<'_>) -> Result<TcpStream, Error> {
        let timeout = self.pool.connect_timeout;
        let stream = tokio::time::timeout(timeout, TcpStream::connect(target.address()))
            .await
            .map_err(|_| Error::ConnectTimeout(timeout))?
            .map_err(Error::Connect)?;
        // Small requests go out at once rather than waiting for an ACK (Nagle).
        stream.set_nodelay(true).map_err(Error::Connect)?;
        Ok(stream)
    }

    fn response(
        &self,
        target: Target<'_>,
        answer: HeadRead,
        runtime: Option<RuntimeId>,
    ) -> Response {
        Response {
            status: answer.status,
            content_type: answer.content_type,
            content_length: match answer.framing {
                Framing::Length(n) => Some(n),
                _ => None,
            },
            body: Body {
                stream: Some(answer.stream),
                buf: answer.buf,
                framing: answer.framing,
                reusable: answer.reusable,
                home: Some(Home {
                    pool: Arc::clone(&self.pool),
                    authority: target.authority.to_owned(),
                    runtime,
                }),
            },
        }
    }
}

impl Pool {
    /// The most recently used idle connection to `authority` made on `runtime` that is
    /// still open.
    fn checkout(&self, authority: &str, runtime: Option<RuntimeId>) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.get_mut(authority)?;
        while let Some(at) = list.iter().rposition(|c| c.runtime == runtime) {
            let conn = list.remove(at)?;
            if conn.since.elapsed() < self.idle_timeout && is_open(&conn.stream) {
                return Some(conn.stream);
            }
        }
        None
    }
}

/// An idle connection is usable when reading it would block: no end of stream (the
/// node closed it) and no stray bytes.
fn is_open(stream: &TcpStream) -> bool {
    matches!(stream.try_read(&mut [0; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// A response head and the connection its body follows on.
struct HeadRead {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    framing: Framing,
    reusable: bool,
    stream: TcpStream,
    /// Bytes read past the head: the start of the body.
    buf: BytesMut,
}

/// Writes the request, reads the answer's head.
async fn exchange(mut stream: TcpStream, head: &[u8], body: &[u8]) -> Result<HeadRead, Error> {
    write_all(&mut stream, &mut [IoSlice::new(head), IoSlice::new(body)])
        .await
        .map_err(Error::Io)?;
    let mut buf = BytesMut::with_capacity(READ_SIZE);
    loop {
        if read_more(&mut stream, &mut buf).await.map_err(Error::Io)? == 0 {
            return Err(if buf.is_empty() {
                Error::Closed
            } else {
                Error::Malformed("the connection closed inside the head")
            });
        }
        while let Some(head) = parse_head(&mut buf)? {
            // An interim answer (`100 Continue`) is followed by the real one.
            if !head.status.is_informational() {
                return Ok(HeadRead {
                    status: head.status,
                    content_type: head.content_type,
                    framing: head.framing,
                    reusable: head.keep_alive,
                    stream,
                    buf,
                });
            }
        }
        if buf.len() > MAX_HEAD {
            return Err(Error::Malformed("the head is too long"));
        }
    }
}

async fn write_all(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        let n = stream.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    use tokio::io::AsyncReadExt;
    make_room(buf);
    stream.read_buf(buf).await
}

/// At least [`READ_MIN`] of room for the next read (see there).
fn make_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_MIN {
        buf.reserve(READ_SIZE);
    }
}

/// What a parsed head says.
struct Head {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    framing: Framing,
    keep_alive: bool,
}

/// Parses a complete head off the front of `buf`; `None` while it is incomplete.
fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(Error::Malformed("too many headers")),
        Err(_) => return Err(Error::Malformed("an unreadable head")),
    };
    let status = parsed
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or(Error::Malformed("an unreadable status"))?;
    let mut keep_alive = parsed.version == Some(1);
    let (mut content_type, mut length, mut chunked) = (None, None, false);
    for header in parsed.headers.iter() {
        let value = header.value;
        if header.name.eq_ignore_ascii_case("content-type") {
            content_type = HeaderValue::from_bytes(value).ok();
        } else if header.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or(Error::Malformed("an unreadable content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(Error::Malformed("conflicting content-lengths"));
            }
            length = Some(n);
        } else if header.name.eq_ignore_ascii_case("transfer-encoding") {
            // Chunked is the last coding when present (RFC 9112 6.1).
            chunked = has_token(value, "chunked");
        } else if header.name.eq_ignore_ascii_case("connection") {
            if has_token(value, "close") {
                keep_alive = false;
            } else if has_token(value, "keep-alive") {
                keep_alive = true;
            }
        }
    }
    let framing = if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        Framing::Length(0)
    } else if chunked {
        Framing::Chunked(Chunk::Size)
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        keep_alive = false;
        Framing::UntilClose
    };
    buf.advance(len);
    Ok(Some(Head {
        status,
        content_type,
        framing,
        keep_alive,
    }))
}

fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// A forwarded request's answer: its head, and its body to be read.
pub struct Response {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    /// The body's length, when the head gave one.
    pub content_length: Option<u64>,
    pub body: Body,
}

/// How the body's end is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes are still to come.
    Length(u64),
    Chunked(Chunk),
    /// Until the node closes the connection.
    UntilClose,
    Done,
}

/// Where a chunked body's decoder stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes to go.
    Data(u64),
    /// At the line end after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until a blank one.
    Trailer,
}

/// What the bytes in the buffer gave.
enum Decoded {
    Data(Bytes),
    /// Nothing more without another read.
    Need,
    Done,
}

/// A response body. Every chunk already read is yielded without waiting; a read is
/// made only when none is left. Read to its end, the connection goes back to the pool;
/// dropped before, it is closed (which tells vLLM to stop generating).
pub struct Body {
    stream: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    reusable: bool,
    home: Option<Home>,
}

impl Body {
    /// Takes what the buffer holds of the body.
    fn decode(&mut self) -> Result<Decoded, Error> {
        loop {
            match self.framing {
                Framing::Done => return Ok(Decoded::Done),
                Framing::Length(0) => self.framing = Framing::Done,
                Framing::Length(rest) => {
                    let Some(data) = take_data(&mut self.buf, rest) else {
                        return Ok(Decoded::Need);
                    };
                    self.framing = Framing::Length(rest - data.len() as u64);
                    return Ok(Decoded::Data(data));
                }
                Framing::UntilClose => {
                    if self.buf.is_empty() {
                        return Ok(Decoded::Need);
                    }
                    return Ok(Decoded::Data(self.buf.split().freeze()));
                }
                Framing::Chunked(Chunk::Data(0)) => self.framing = Framing::Chunked(Chunk::DataEnd),
                Framing::Chunked(Chunk::Data(rest)) => {
                    let Some(data) = take_data(&mut self.buf, rest) else {
                        return Ok(Decoded::Need);
                    };
                    self.framing = Framing::Chunked(Chunk::Data(rest - data.len() as u64));
                    return Ok(Decoded::Data(data));
                }
                Framing::Chunked(Chunk::DataEnd) => {
                    let ended = take_line(&mut self.buf, |line| {
                        if line.is_empty() {
                            Ok(())
                        } else {
                            Err(Error::Malformed("a chunk longer than its size"))
                        }
                    })?;
                    if ended.is_none() {
                        return Ok(Decoded::Need);
                    }
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Framing::Chunked(Chunk::Size) => {
                    let Some(size) = take_line(&mut self.buf, chunk_size)? else {
                        return Ok(Decoded::Need);
                    };
                    self.framing = Framing::Chunked(if size == 0 {
                        Chunk::Trailer
                    } else {
                        Chunk::Data(size)
                    });
                }
                Framing::Chunked(Chunk::Trailer) => {
                    let Some(blank) = take_line(&mut self.buf, |line| Ok(line.is_empty()))? else {
                        return Ok(Decoded::Need);
                    };
                    if blank {
                        self.framing = Framing::Done;
                    }
                }
            }
        }
    }

    /// At the body's end: the connection goes back to the pool if it can be reused.
    fn finished(&mut self) {
        self.framing = Framing::Done;
        let stream = self.stream.take();
        if let (Some(stream), Some(home)) = (stream, self.home.take())
            && self.reusable
            && self.buf.is_empty()
        {
            home.checkin(stream);
        }
    }
}

/// Up to `rest` bytes of data off the front of `buf`; `None` when it is empty.
fn take_data(buf: &mut BytesMut, rest: u64) -> Option<Bytes> {
    if buf.is_empty() {
        return None;
    }
    let n = usize::try_from(rest).unwrap_or(usize::MAX).min(buf.len());
    Some(buf.split_to(n).freeze())
}

/// Reads the line at the front of `buf`, without its `\r\n` (or bare `\n`), with
/// `read` where it lies, then drops it from `buf` (a line split off as a buffer of its
/// own cost a reference count taken and given back, twice a chunk); `None` while it is
/// incomplete.
fn take_line<T>(
    buf: &mut BytesMut,
    read: impl FnOnce(&[u8]) -> Result<T, Error>,
) -> Result<Option<T>, Error> {
    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
        if buf.len() > MAX_LINE {
            return Err(Error::Malformed("a chunk line is too long"));
        }
        return Ok(None);
    };
    let line = &buf[..end];
    let value = read(line.strip_suffix(b"\r").unwrap_or(line))?;
    buf.advance(end + 1);
    Ok(Some(value))
}

/// The hex size of a chunk-size line, extensions (`;…`) ignored.
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    // Read digit by digit rather than as a `str` by `u64::from_str_radix`, whose UTF-8
    // check alone cost ~60 instructions a frame (one chunk a frame from vLLM).
    let unreadable = Error::Malformed("an unreadable chunk size");
    if digits.is_empty() || digits.len() > 16 {
        return Err(unreadable);
    }
    digits
        .iter()
        .try_fold(0, |size: u64, &digit| {
            Some(size << 4 | u64::from(char::from(digit).to_digit(16)?))
        })
        .ok_or(unreadable)
}

impl Stream for Body {
    type Item = io::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            match this.decode() {
                Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(data))),
                Ok(Decoded::Done) => {
                    this.finished();
                    return Poll::Ready(None);
                }
                Ok(Decoded::Need) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(err)))),
            }
            let Some(stream) = this.stream.as_mut() else {
                return Poll::Ready(None);
            };
            make_room(&mut this.buf);
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(stream),
                cx,
                &mut this.buf
            ));
            match read {
                Ok(0) if this.framing == Framing::UntilClose => {
                    this.reusable = false;
                    this.finished();
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    let err = Error::Malformed("the connection closed inside the body");
                    return Poll::Ready(Some(Err(this.fail(err))));
                }
                Ok(_) => {}
                Err(err) => return Poll::Ready(Some(Err(this.fail(Error::Io(err))))),
            }
        }
    }
}

impl Body {
    /// Ends the body with an error; the connection is closed.
    fn fail(&mut self, err: Error) -> io::Error {
        self.reusable = false;
        self.finished();
        io::Error::other(err)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures_util::StreamExt;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    use super::*;

    #[test]
    fn plain_http_urls_are_split_and_others_left_to_reqwest() {
        let t = Target::parse("http://10.0.0.7:8000").unwrap();
        assert_eq!(
            (t.authority, t.base, t.address().as_str()),
            ("10.0.0.7:8000", "", "10.0.0.7:8000")
        );
        let t = Target::parse("http://gpu-3/vllm/").unwrap();
        assert_eq!(
            (t.authority, t.base, t.address().as_str()),
            ("gpu-3", "/vllm", "gpu-3:80")
        );
        assert_eq!(Target::parse("http://[::1]").unwrap().address(), "[::1]:80");
        assert_eq!(
            Target::parse("http://[::1]:9").unwrap().address(),
            "[::1]:9"
        );
        for other in [
            "https://gpu-3",
            "http://user:pw@gpu-3",
            "http://gpu-3/?q",
            "http://",
            "gpu-3",
        ] {
            assert_eq!(Target::parse(other), None, "{other}");
        }
    }

    /// A body whose bytes are all in the buffer already.
    fn buffered(framing: Framing, bytes: &[u8]) -> Body {
        Body {
            stream: None,
            buf: BytesMut::from(bytes),
            framing,
            reusable: false,
            home: None,
        }
    }

    /// Decodes what the buffer holds: the data, and whether the body ended.
    fn drain(body: &mut Body) -> Result<(Vec<u8>, bool), Error> {
        let mut data = Vec::new();
        loop {
            match body.decode()? {
                Decoded::Data(d) => data.extend_from_slice(&d),
                Decoded::Need => return Ok((data, false)),
                Decoded::Done => return Ok((data, true)),
            }
        }
    }

    const CHUNKED: &[u8] = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\nworld!\n0\r\ntrailer: x\r\n\r\n";

    #[test]
    fn a_chunked_body_decodes_whole_and_cut_at_every_byte() {
        let mut body = buffered(Framing::Chunked(Chunk::Size), CHUNKED);
        assert_eq!(drain(&mut body).unwrap(), (b"hello world!".to_vec(), true));
        for cut in 0..CHUNKED.len() {
            let mut body = buffered(Framing::Chunked(Chunk::Size), &CHUNKED[..cut]);
            let (mut data, done) = drain(&mut body).unwrap();
            assert!(!done, "cut at {cut}: not over before the last chunk");
            body.buf.extend_from_slice(&CHUNKED[cut..]);
            let (rest, done) = drain(&mut body).unwrap();
            data.extend_from_slice(&rest);
            assert_eq!(
                (data.as_slice(), done),
                (&b"hello world!"[..], true),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn chunks_already_read_come_out_one_after_another_without_a_read() {
        let mut body = buffered(Framing::Chunked(Chunk::Size), b"2\r\nab\r\n2\r\ncd\r\n");
        let mut pieces = Vec::new();
        while let Decoded::Data(d) = body.decode().unwrap() {
            pieces.push(d);
        }
        assert_eq!(pieces, [&b"ab"[..], &b"cd"[..]]);
    }

    #[test]
    fn broken_chunked_framing_is_an_error() {
        for bad in [&b"zz\r\n"[..], b"2\r\nabc\r\n", b"11111111111111111\r\n"] {
            let mut body = buffered(Framing::Chunked(Chunk::Size), bad);
            assert!(
                drain(&mut body).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn chunk_sizes_are_hex_digits_only() {
        for (line, size) in [
            (&b"0"[..], 0),
            (b"1a", 26),
            (b"1A ; name=value", 26),
            (b" 404B\t", 0x404b),
            (b"ffffFFFFffffFFFF", u64::MAX),
        ] {
            assert_eq!(chunk_size(line).ok(), Some(size), "{line:?}");
        }
        for line in [
            &b""[..],
            b" ",
            b"+5",
            b"-1",
            b"0x5",
            b"5 5",
            b"g",
            b"1\xc3\xa9",
            b"10000000000000000",
        ] {
            assert!(chunk_size(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn a_sized_body_stops_at_its_length() {
        let mut body = buffered(Framing::Length(3), b"abc");
        assert_eq!(drain(&mut body).unwrap(), (b"abc".to_vec(), true));
        let mut body = buffered(Framing::Length(5), b"abc");
        assert_eq!(drain(&mut body).unwrap(), (b"abc".to_vec(), false));
    }

    #[test]
    fn heads_give_status_type_framing_and_keep_alive() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n"[..],
        );
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.content_type.unwrap(), "text/event-stream");
        assert_eq!(
            (head.framing, head.keep_alive),
            (Framing::Chunked(Chunk::Size), true)
        );
        assert_eq!(&buf[..], b"5\r\n", "the body's start stays in the buffer");

        let mut buf = BytesMut::from(
            &b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"[..],
        );
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(
            (head.status.as_u16(), head.framing, head.keep_alive),
            (400, Framing::Length(2), false)
        );

        let mut buf = BytesMut::from(&b"HTTP/1.0 200 OK\r\n\r\n"[..]);
        let head = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(
            (head.framing, head.keep_alive),
            (Framing::UntilClose, false)
        );

        assert!(
            parse_head(&mut BytesMut::from(&b"HTTP/1.1 200 OK\r\ncont"[..]))
                .unwrap()
                .is_none()
        );
        let conflicting = b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n";
        assert!(parse_head(&mut BytesMut::from(&conflicting[..])).is_err());
        assert!(parse_head(&mut BytesMut::from(&b"SMTP hello\r\n\r\n"[..])).is_err());
    }

    /// A node that answers every request on a connection with `answer`, then, if
    /// `close_after` is set, closes the connection after that many answers. Counts the
    /// connections it accepted.
    async fn node(answer: &'static [u8], close_after: Option<usize>) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut answered = 0;
                    while close_after != Some(answered) {
                        // Each request is a head and a body of its content-length.
                        let mut chunk = [0; 4096];
                        let n = conn.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let text = String::from_utf8_lossy(&buf).into_owned();
                        let Some(end) = text.find("\r\n\r\n") else {
                            continue;
                        };
                        let length: usize = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |v| v.parse().unwrap());
                        if buf.len() < end + 4 + length {
                            continue;
                        }
                        buf.drain(..end + 4 + length);
                        conn.write_all(answer).await.unwrap();
                        answered += 1;
                    }
                });
            }
        });
        (url, accepted)
    }

    async fn post(client: &Client, url: &str) -> Result<(StatusCode, Vec<u8>), Error> {
        let response = client
            .post_json(
                Target::parse(url).unwrap(),
                "/v1/completions",
                &HeaderMap::new(),
                b"{}",
            )
            .await?;
        let status = response.status;
        let mut body = response.body;
        let mut data = Vec::new();
        while let Some(chunk) = body.next().await {
            data.extend_from_slice(&chunk.map_err(Error::Io)?);
        }
        Ok((status, data))
    }

    fn client() -> Client {
        Client::new(Duration::from_secs(2), Duration::from_secs(3))
    }

    const SSE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n0\r\n\r\n";

    #[tokio::test]
    async fn a_connection_read_to_its_end_is_reused() {
        let (url, accepted) = node(SSE, None).await;
        let client = client();
        for _ in 0..3 {
            let (status, body) = post(&client, &url).await.unwrap();
            assert_eq!(
                (status, body.as_slice()),
                (StatusCode::OK, &b"data: a\n\n"[..])
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// Each connection thread is a runtime of its own: a connection made on one is
    /// never handed to another (its reads would be woken by the first's thread).
    #[tokio::test]
    async fn a_pooled_connection_is_reused_only_on_the_runtime_that_made_it() {
        let (url, accepted) = node(SSE, None).await;
        let client = client();
        let other = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        );
        let on_other = || {
            let (client, url, other) = (client.clone(), url.clone(), Arc::clone(&other));
            tokio::task::spawn_blocking(move || {
                other.block_on(async { post(&client, &url).await.map(|a| a.1) })
            })
        };
        assert_eq!(post(&client, &url).await.unwrap().1, b"data: a\n\n");
        assert_eq!(on_other().await.unwrap().unwrap(), b"data: a\n\n");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "one connection per runtime"
        );
        post(&client, &url).await.unwrap();
        on_other().await.unwrap().unwrap();
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "each runtime reused its own"
        );
        // A runtime cannot be dropped on a runtime's thread.
        tokio::task::spawn_blocking(move || drop(other))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_connection_the_node_closed_while_idle_is_replaced() {
        let (url, accepted) = node(SSE, Some(1)).await;
        let client = client();
        for _ in 0..3 {
            assert_eq!(post(&client, &url).await.unwrap().1, b"data: a\n\n");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        let (url, accepted) = node(SSE, None).await;
        let client = client();
        let response = client
            .post_json(
                Target::parse(&url).unwrap(),
                "/v1/completions",
                &HeaderMap::new(),
                b"{}",
            )
            .await
            .unwrap();
        drop(response);
        post(&client, &url).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_node_that_closes_without_answering_is_an_error() {
        let (url, _) = node(b"", Some(0)).await;
        assert!(matches!(
            post(&client(), &url).await,
            Err(Error::Closed | Error::Io(_))
        ));
        let refused = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", listener.local_addr().unwrap())
        };
        assert!(matches!(
            post(&client(), &refused).await,
            Err(Error::Connect(_))
        ));
    }
}
