//! hyper's answer to an HTTP/1 request head it cannot parse, replaced by the error
//! envelope on its way to the socket.
//!
//! hyper answers such a head itself, before there is a request for the router to see:
//! 400 for a malformed one, 431 for one over the limits (`Server::on_error` in hyper's
//! `proto/h1/role.rs`), as a bare head — `connection: close`, `content-length: 0`,
//! `date` — and then closes the connection. It has no hook to change that answer, so
//! [`HeadErrors`] recognises it in what hyper writes and writes the envelope, with an
//! `X-Request-Id` of its own, in its place. (hyper's 414, for a URI over 65,534 bytes,
//! never comes: `MAX_HEAD_BYTES` refuses such a head first.)
//!
//! Recognising it touches no other response. The write must be that bare head, whole
//! and alone: a 400 or 431 status line, no header but `connection`, `content-length: 0`
//! and `date`, nothing after. No response of the router is one — each carries
//! `X-Request-Id` (the envelope middleware sets it on all of them) and each error has a
//! body — and a response body could be taken for one only by holding those very bytes,
//! CRLFs included, at the start of a write: ours are JSON or text with bare LFs, vLLM's
//! JSON or SSE. hyper writes its answer only when no response is under way
//! (`Conn::on_parse_error`), so it starts a write of its own — unless the response
//! before it, to a pipelined request, is not all written yet; then it goes out as
//! hyper wrote it. Every write pays a comparison of its first ten bytes; only a short
//! 4xx head is read further, and only hyper's answer allocates.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::ApiError;
use crate::http::every_request;

/// The most a request head (start line and headers) may hold: 431 once this much of
/// one has come without its end. hyper's default bound is its whole read buffer,
/// ~400 KB, which a client can fill on every connection it opens (4 GB at the default
/// `connections.max_open`). 16 KiB is far above an API client's head (a few hundred
/// bytes); it is Node's limit, and hyper's HTTP/2 default for the header list.
///
/// In HTTP/1 it is the size of hyper's read buffer (hyper-util's builder has no separate
/// head limit): a body is read 16 KiB at a time too, and hyper takes no more of a
/// response body while 16 KiB of it wait to be written. It also keeps hyper's 414 (a URI
/// over 65,534 bytes) from ever coming: such a head is refused long before its URI ends.
pub(super) const MAX_HEAD_BYTES: usize = 16 * 1024;
/// The most header lines an HTTP/1 request head may have: hyper's default, not set
/// through the builder (that puts the parser's header array on the heap for every
/// request). Only named here, for the 431's message.
const MAX_HEADER_LINES: usize = 100;

/// A client connection's IO on which hyper's bare answers to request heads it could not
/// parse go out as error envelopes; everything else passes through untouched.
pub(super) struct HeadErrors<T> {
    io: T,
    /// The envelope standing in for hyper's answer, while it is being written.
    replacing: Option<Replacement>,
}

impl<T> HeadErrors<T> {
    pub(super) fn new(io: T) -> Self {
        Self {
            io,
            replacing: None,
        }
    }

    /// The connection's IO, once hyper is done with it.
    pub(super) fn into_inner(self) -> T {
        self.io
    }
}

/// An envelope response being written in place of hyper's answer.
struct Replacement {
    bytes: Vec<u8>,
    /// How many of `bytes` the socket has taken.
    sent: usize,
    /// The length of hyper's answer, reported to hyper as written once all of `bytes`
    /// are: until then hyper keeps offering the same answer, and this goes on with the
    /// rest of `bytes` whatever hyper offers.
    stands_for: usize,
}

impl Replacement {
    /// The envelope for hyper's `answer` (`answer_len` bytes long): the error's
    /// status and headers as the router would give them, the length, `connection:
    /// close` (hyper closes the connection next) and hyper's date.
    fn new(answer: &BareAnswer<'_>, answer_len: usize) -> Self {
        let (parts, body) = every_request::unrouted(answer.error());
        let status = parts.status;
        let reason = status.canonical_reason().unwrap_or_default();
        let mut bytes = format!("{} {} {reason}", answer.version, status.as_str()).into_bytes();
        let mut header = |name: &str, value: &[u8]| {
            bytes.extend_from_slice(b"\r\n");
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(b": ");
            bytes.extend_from_slice(value);
        };
        for (name, value) in &parts.headers {
            header(name.as_str(), value.as_bytes());
        }
        header("content-length", body.len().to_string().as_bytes());
        header("connection", b"close");
        if let Some(date) = answer.date {
            header("date", date.as_bytes());
        }
        bytes.extend_from_slice(b"\r\n\r\n");
        bytes.extend_from_slice(&body);
        Self {
            bytes,
            sent: 0,
            stands_for: answer_len,
        }
    }

    /// Writes the rest of the envelope; then reports hyper's answer (of which hyper
    /// offers `offered` bytes) as written.
    fn poll_send<T: AsyncWrite + Unpin>(
        &mut self,
        io: &mut T,
        cx: &mut Context<'_>,
        offered: usize,
    ) -> Poll<io::Result<usize>> {
        while self.sent < self.bytes.len() {
            let n = ready!(Pin::new(&mut *io).poll_write(cx, &self.bytes[self.sent..]))?;
            if n == 0 {
                // hyper takes a zero-length write as the socket closing (WriteZero).
                return Poll::Ready(Ok(0));
            }
            self.sent += n;
        }
        Poll::Ready(Ok(self.stands_for.min(offered)))
    }
}

/// More than hyper's bare answer can be: its status line and three short headers.
const BARE_ANSWER_MAX: usize = 256;

/// hyper's bare answer to a request head it could not parse.
#[derive(Debug, PartialEq)]
struct BareAnswer<'a> {
    /// `HTTP/1.1`, or `HTTP/1.0` on a connection that spoke it.
    version: &'a str,
    too_large: bool,
    /// hyper's `date` header, kept for the envelope.
    date: Option<&'a str>,
}

impl BareAnswer<'_> {
    /// hyper's answer, if `write` is exactly one: the status line `HTTP/1.x 400 Bad
    /// Request` or `HTTP/1.x 431 Request Header Fields Too Large`, then no header but
    /// `content-length: 0` (which it must have), `connection: close` and `date`, and
    /// nothing after the head.
    fn parse(write: &[u8]) -> Option<BareAnswer<'_>> {
        // The test every write takes: a 4xx status line, and not longer than hyper's
        // answer can be (so that a 4xx response of the router with its body, written
        // in one piece, is not read through).
        let start = write.get(..10)?;
        if !(start.starts_with(b"HTTP/1.") && start[9] == b'4') || write.len() > BARE_ANSWER_MAX {
            return None;
        }
        let head = std::str::from_utf8(write).ok()?.strip_suffix("\r\n\r\n")?;
        let mut lines = head.split("\r\n");
        let (version, status) = lines.next()?.split_once(' ')?;
        let too_large = match status {
            "400 Bad Request" => false,
            "431 Request Header Fields Too Large" => true,
            _ => return None,
        };
        let (mut empty, mut date) = (false, None);
        for line in lines {
            match line.split_once(": ")? {
                ("content-length", "0") => empty = true,
                ("connection", "close") => {}
                ("date", value) => date = Some(value),
                _ => return None,
            }
        }
        empty.then_some(BareAnswer {
            version,
            too_large,
            date,
        })
    }

    fn error(&self) -> ApiError {
        if self.too_large {
            ApiError::HeadTooLarge {
                max_bytes: MAX_HEAD_BYTES,
                max_lines: MAX_HEADER_LINES,
            }
        } else {
            ApiError::MalformedHead
        }
    }
}

impl<T: AsyncWrite + Unpin> HeadErrors<T> {
    /// Writes the envelope in place of `write` (`offered` bytes in all) if `write` is
    /// hyper's bare answer, or goes on writing the one under way; `None` otherwise.
    fn poll_replace(
        &mut self,
        cx: &mut Context<'_>,
        write: &[u8],
        offered: usize,
    ) -> Option<Poll<io::Result<usize>>> {
        if self.replacing.is_none() {
            self.replacing =
                BareAnswer::parse(write).map(|answer| Replacement::new(&answer, write.len()));
        }
        let sent = self
            .replacing
            .as_mut()?
            .poll_send(&mut self.io, cx, offered);
        if sent.is_ready() {
            // Done (or failed): whatever hyper writes next passes through.
            self.replacing = None;
        }
        Some(sent)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HeadErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HeadErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.poll_replace(cx, buf, buf.len()) {
            Some(replaced) => replaced,
            None => Pin::new(&mut self.io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's answer goes out as the only non-empty slice of a write.
        let offered = bufs.iter().map(|buf| buf.len()).sum();
        let alone = bufs
            .iter()
            .find(|buf| buf.len() == offered)
            .map_or(&[][..], |buf| &buf[..]);
        match self.poll_replace(cx, alone, offered) {
            Some(replaced) => replaced,
            None => Pin::new(&mut self.io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::io::IoSlice;

    use futures_util::future::poll_fn;

    use super::*;

    /// hyper's answers as it writes them (`date` aside).
    const MALFORMED: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Wed, 02 Dec 2026 00:46:41 GMT\r\n\r\n";
    const TOO_LARGE: &[u8] = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Wed, 02 Dec 2026 00:46:41 GMT\r\n\r\n";

    #[test]
    fn only_hypers_bare_answers_are_recognised() {
        let date = Some("Wed, 02 Dec 2026 00:46:41 GMT");
        let answer = |version, too_large, date| {
            Some(BareAnswer {
                version,
                too_large,
                date,
            })
        };
        assert_eq!(
            BareAnswer::parse(MALFORMED),
            answer("HTTP/1.1", false, date)
        );
        assert_eq!(BareAnswer::parse(TOO_LARGE), answer("HTTP/1.1", true, date));
        // On a connection that spoke HTTP/1.0 hyper answers in it, without `connection`.
        assert_eq!(
            BareAnswer::parse(b"HTTP/1.0 400 Bad Request\r\ncontent-length: 0\r\n\r\n"),
            answer("HTTP/1.0", false, None)
        );
        let others: [&[u8]; 7] = [
            // The router's: an id, a body.
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nx-request-id: req_1\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            // Not whole, or not alone.
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}",
            b"{\"error\":{}}",
        ];
        for write in others {
            assert_eq!(BareAnswer::parse(write), None, "{write:?}");
        }
    }

    /// A socket that takes at most 7 bytes a write, and is not ready every other time.
    #[derive(Default)]
    struct Trickle {
        taken: Vec<u8>,
        ready: bool,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.ready = !self.ready;
            if !self.ready {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let n = buf.len().min(7);
            self.taken.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Writes `bytes` as hyper does (vectored, offering what is left until all is
    /// taken); returns what each write reported taken.
    async fn write_like_hyper(io: &mut HeadErrors<Trickle>, bytes: &[u8]) -> Vec<usize> {
        let mut taken = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let slices = [IoSlice::new(&[]), IoSlice::new(rest)];
            let n = poll_fn(|cx| Pin::new(&mut *io).poll_write_vectored(cx, &slices))
                .await
                .unwrap();
            taken.push(n);
            rest = &rest[n..];
        }
        taken
    }

    #[tokio::test]
    async fn hypers_answer_goes_out_whole_as_the_envelope_through_partial_writes() {
        let mut io = HeadErrors::new(Trickle::default());
        // hyper's answer is taken in one piece, once the envelope is all out.
        assert_eq!(
            write_like_hyper(&mut io, TOO_LARGE).await,
            [TOO_LARGE.len()]
        );
        let sent = String::from_utf8(io.io.taken).unwrap();
        let (head, body) = sent.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        assert_eq!(
            lines.next(),
            Some("HTTP/1.1 431 Request Header Fields Too Large")
        );
        let headers: Vec<(&str, &str)> = lines.map(|l| l.split_once(": ").unwrap()).collect();
        let header = |name| headers.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(header("content-length"), body.len().to_string());
        assert_eq!(header("connection"), "close");
        assert_eq!(header("date"), "Wed, 02 Dec 2026 00:46:41 GMT");
        assert_eq!(header("x-should-retry"), "false");
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "request_too_large");
        assert_eq!(body["request_id"], header("x-request-id"));
        assert!(io.replacing.is_none());
    }

    #[tokio::test]
    async fn every_other_write_passes_through_as_it_is() {
        let mut io = HeadErrors::new(Trickle::default());
        // The router's error, its head and body written apart, as hyper does.
        let head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nx-request-id: req_1\r\ncontent-length: 2\r\n\r\n";
        write_like_hyper(&mut io, head).await;
        write_like_hyper(&mut io, b"{}").await;
        assert_eq!(io.io.taken, [&head[..], b"{}"].concat());
    }
}
