//! Slow, greedy and broken clients: a connection that sends nothing, trickles its
//! headers or its body, or comes beyond the connection cap is let go, counted and
//! answered as documented — instead of being held for as long as the client likes; a
//! request head hyper cannot parse, or one over the limits, is answered in the error
//! envelope like every other error, counted, and the connection closed.

use std::time::{Duration, Instant};

use mock_vllm::MockConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{Gateway, parse_metrics};

/// Upper bound on every wait here.
pub(crate) const LIMIT: Duration = Duration::from_secs(10);
/// The header and body time-outs of these tests.
const TIMEOUT_MS: u64 = 300;

async fn gateway(max_open: usize) -> Gateway {
    Gateway::start_with(
        MockConfig::default(),
        &format!(
            "[connections]\nmax_open = {max_open}\nheader_read_timeout_ms = {TIMEOUT_MS}\nbody_read_timeout_ms = {TIMEOUT_MS}\n"
        ),
    )
    .await
}

pub(crate) async fn connect(gw: &Gateway) -> TcpStream {
    TcpStream::connect(gw.url.trim_start_matches("http://"))
        .await
        .unwrap()
}

/// Reads until the server closes the connection; returns what it sent.
pub(crate) async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let read = tokio::time::timeout(LIMIT, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await.expect("the server closed the connection");
    received
}

/// The gateway's `fleetgate_connection_refusals_total` for `reason`. Polls, since the
/// scrape's own connection needs a free slot.
pub(crate) async fn refusals(gw: &Gateway, reason: &str) -> f64 {
    let deadline = Instant::now() + LIMIT;
    let text = loop {
        match gw.client.get(format!("{}/metrics", gw.url)).send().await {
            Ok(response) => break response.text().await.unwrap(),
            Err(err) => assert!(Instant::now() < deadline, "no scrape: {err}"),
        }
        tokio::task::yield_now().await;
    };
    parse_metrics(&text)
        .iter()
        .find(|s| s.name == "fleetgate_connection_refusals_total" && s.labels["reason"] == reason)
        .map_or(0.0, |s| s.value)
}

/// Whether `bytes` hold a response head and the whole body its `Content-Length` gives.
fn whole_response(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes).to_lowercase();
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .and_then(|n| n.trim().parse::<usize>().ok());
    length.is_some_and(|n| body.len() >= n)
}

/// Reads one whole response (head and `Content-Length` body) off `stream`.
pub(crate) async fn read_response(stream: &mut (impl AsyncReadExt + Unpin)) -> Vec<u8> {
    let mut response = Vec::new();
    let read = tokio::time::timeout(LIMIT, async {
        let mut buf = [0u8; 4096];
        while !whole_response(&response) {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => response.extend_from_slice(&buf[..n]),
            }
        }
    });
    read.await.expect("an answer");
    response
}

/// A response as read off the socket: status, headers (names lower-cased), body.
pub(crate) struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Raw {
    pub(crate) fn parse(bytes: &[u8]) -> Self {
        let split = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no whole head in {:?}", String::from_utf8_lossy(bytes)));
        let head = std::str::from_utf8(&bytes[..split]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap();
        let headers = lines
            .map(|line| {
                let (name, value) = line.split_once(':').unwrap();
                (name.to_lowercase(), value.trim().to_owned())
            })
            .collect();
        Self {
            status: status.parse().unwrap(),
            headers,
            body: bytes[split + 4..].to_vec(),
        }
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts the error envelope (status, `error.code` and `error.type`, its length, the
    /// request id in the header and the body) and returns the body.
    pub(crate) fn envelope(&self, status: u16, code: &str, kind: &str) -> serde_json::Value {
        let text = String::from_utf8_lossy(&self.body);
        assert_eq!(self.status, status, "{:?} {text}", self.headers);
        assert_eq!(
            self.header("content-type"),
            Some("application/json"),
            "{:?} {text}",
            self.headers
        );
        let length = self
            .header("content-length")
            .map(|n| n.parse::<usize>().unwrap());
        assert_eq!(length, Some(self.body.len()), "content-length");
        let body: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {text}"));
        assert_eq!(body["error"]["code"], code, "{body}");
        assert_eq!(body["error"]["type"], kind, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        let id = self.header("x-request-id").expect("an x-request-id header");
        assert!(id.starts_with("req_"), "{id}");
        assert_eq!(body["request_id"], id, "{body}");
        body
    }
}

/// Sends `request` on a new connection and asserts the answer to a request head hyper
/// could not parse: the envelope, and the connection closed (within [`LIMIT`]). Returns
/// the message.
async fn assert_head_refused(gw: &Gateway, request: &[u8], status: u16, code: &str) -> String {
    let mut stream = connect(gw).await;
    stream.write_all(request).await.unwrap();
    let answer = Raw::parse(&read_until_closed(&mut stream).await);
    let body = answer.envelope(status, code, "invalid_request_error");
    assert_eq!(answer.header("connection"), Some("close"));
    body["error"]["message"].as_str().unwrap().to_owned()
}

/// Asserts that each of `requests` gets the answer of [`assert_head_refused`], with
/// one message for all: it shows nothing of what was sent.
async fn assert_heads_refused(gw: &Gateway, requests: &[&[u8]], status: u16, code: &str) {
    let mut messages = Vec::new();
    for request in requests {
        messages.push(assert_head_refused(gw, request, status, code).await);
    }
    messages.dedup();
    assert_eq!(messages.len(), 1, "{messages:?}");
}

/// Header lines `X-Filler-{i}: {i}` for `i` in `0..n`.
fn filler_headers(n: usize) -> String {
    (0..n).map(|i| format!("X-Filler-{i}: {i}\r\n")).collect()
}

/// `prefix` and then `a`s, `len` bytes in all.
fn padded(prefix: &str, len: usize) -> String {
    prefix.to_owned() + &"a".repeat(len - prefix.len())
}

/// The limit on a request head (start line and headers) docs/configuration.md documents.
const MAX_HEAD_BYTES: usize = 16 * 1024;

#[tokio::test]
async fn a_silent_or_idle_connection_is_closed_when_its_request_head_is_due() {
    let gw = gateway(100).await;
    // Nothing at all.
    let mut silent = connect(&gw).await;
    let opened = Instant::now();
    assert!(read_until_closed(&mut silent).await.is_empty());
    assert!(opened.elapsed() >= Duration::from_millis(TIMEOUT_MS - 50));

    // Kept alive after a whole exchange, then idle.
    let mut idle = connect(&gw).await;
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answered = read_until_closed(&mut idle).await;
    assert!(answered.starts_with(b"HTTP/1.1 200"), "{answered:?}");
    assert_eq!(refusals(&gw, "header_timeout").await, 2.0);
}

#[tokio::test]
async fn headers_trickled_byte_by_byte_are_cut_when_due() {
    let gw = gateway(100).await;
    let mut stream = connect(&gw).await;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n",
        gw.key
    );
    let started = Instant::now();
    // One byte every 20 ms: the whole head would take several times the time-out.
    let mut cut = false;
    for byte in head.bytes() {
        if stream.write_all(&[byte]).await.is_err() {
            cut = true;
            break;
        }
        let mut probe = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(20), stream.read(&mut probe)).await {
            Err(_) => {}
            Ok(Ok(0) | Err(_)) => {
                cut = true;
                break;
            }
            Ok(Ok(_)) => panic!("the server answered a head it never got whole"),
        }
    }
    assert!(
        cut,
        "the whole head went through in {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < LIMIT);
    assert_eq!(refusals(&gw, "header_timeout").await, 1.0);
    assert!(gw.upstream_completions().is_empty());
}

#[tokio::test]
async fn a_body_trickled_past_its_time_gets_408_in_the_envelope() {
    let gw = gateway(100).await;
    let body = r#"{"model":"llama-8b","prompt":"Hi","max_tokens":2}"#;
    let stream = connect(&gw).await;
    let (mut reader, mut writer) = stream.into_split();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        gw.key,
        body.len()
    );
    writer.write_all(head.as_bytes()).await.unwrap();
    // One byte every 50 ms, until the server has answered (or the body is sent).
    let trickle = tokio::spawn(async move {
        for byte in body.bytes() {
            if writer.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let response = read_response(&mut reader).await;
    trickle.abort();
    let text = String::from_utf8_lossy(&response).to_lowercase();
    assert!(text.starts_with("http/1.1 408"), "{text}");
    assert!(text.contains("x-request-id: req_"), "{text}");
    assert!(text.contains(r#""code":"request_timeout""#), "{text}");
    assert!(
        gw.upstream_completions().is_empty(),
        "nothing was forwarded"
    );
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_at_once() {
    let gw = gateway(2).await;
    let held = [connect(&gw).await, connect(&gw).await];
    // Both are being served (each has a slot) once a request on them is answered.
    let mut held = held;
    for stream in &mut held {
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"HTTP/1.1 200");
    }
    let mut beyond = connect(&gw).await;
    let refused_at = Instant::now();
    let _ = beyond
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    assert!(read_until_closed(&mut beyond).await.is_empty(), "no answer");
    assert!(
        refused_at.elapsed() < Duration::from_millis(TIMEOUT_MS),
        "closed at once, not by the head time-out"
    );
    drop(held);
    assert!(refusals(&gw, "max_open").await >= 1.0);
}

#[tokio::test]
async fn a_malformed_request_head_gets_400_in_the_envelope_and_the_connection_closes() {
    let gw = gateway(100).await;
    let malformed: [&[u8]; 3] = [
        // An unknown HTTP version.
        b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        // Not HTTP at all (the start of a TLS ClientHello, then junk).
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 garbage\r\n\r\n",
        // A header line without a colon.
        b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
    ];
    assert_heads_refused(&gw, &malformed, 400, "invalid_request").await;
    assert_eq!(refusals(&gw, "malformed_head").await, 3.0);
    assert_eq!(refusals(&gw, "head_too_large").await, 0.0);
}

#[tokio::test]
async fn a_request_head_over_the_limits_gets_431_in_the_envelope() {
    let gw = gateway(100).await;
    let start = "GET /health HTTP/1.1\r\nHost: x\r\n";
    // At the limits: 100 header lines (Host included), a head of exactly 16 KiB.
    let at_limit = [
        format!("{start}{}\r\n", filler_headers(99)),
        padded(&format!("{start}X-Big: "), MAX_HEAD_BYTES - 4) + "\r\n\r\n",
    ];
    for request in at_limit {
        let mut stream = connect(&gw).await;
        stream.write_all(request.as_bytes()).await.unwrap();
        let answer = Raw::parse(&read_response(&mut stream).await);
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    // Just over them. The long heads are sent no further than the limit, so that the
    // server has read every byte when it closes (unread bytes would make it a reset).
    let over = [
        format!("{start}{}\r\n", filler_headers(100)),
        padded(&format!("{start}X-Big: "), MAX_HEAD_BYTES),
        // A URI as long (hyper's own limit on URIs, 65,534 bytes, is never reached).
        padded("GET /", MAX_HEAD_BYTES),
    ];
    let over = over.each_ref().map(|request| request.as_bytes());
    assert_heads_refused(&gw, &over, 431, "request_too_large").await;
    assert_eq!(refusals(&gw, "head_too_large").await, 3.0);
    assert_eq!(refusals(&gw, "malformed_head").await, 0.0);
}

#[tokio::test]
async fn answers_on_a_keep_alive_connection_are_untouched_until_a_malformed_head() {
    let gw = gateway(100).await;
    let mut stream = connect(&gw).await;
    let health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    stream.write_all(health).await.unwrap();
    let first = Raw::parse(&read_response(&mut stream).await);
    assert_eq!(first.status, 200);
    assert!(first.header("x-request-id").is_some());

    // The router's own 400, with its own message and id, on the same connection.
    let bad_json = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 1\r\n\r\n{{",
        gw.key
    );
    stream.write_all(bad_json.as_bytes()).await.unwrap();
    let rejected = Raw::parse(&read_response(&mut stream).await);
    let body = rejected.envelope(400, "invalid_request", "invalid_request_error");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("JSON"),
        "{body}"
    );
    assert_eq!(rejected.header("connection"), None, "kept alive");
    assert_ne!(
        rejected.header("x-request-id"),
        first.header("x-request-id")
    );

    stream.write_all(health).await.unwrap();
    assert_eq!(Raw::parse(&read_response(&mut stream).await).status, 200);

    // Then a head hyper cannot parse, on the connection it already served three times.
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost x\r\n\r\n")
        .await
        .unwrap();
    let refused = Raw::parse(&read_until_closed(&mut stream).await);
    refused.envelope(400, "invalid_request", "invalid_request_error");
    assert_eq!(refused.header("connection"), Some("close"));
    assert_eq!(refusals(&gw, "malformed_head").await, 1.0);
    assert!(gw.upstream_completions().is_empty());
}

/// The statuses of the whole responses (each with its `Content-Length` body) at the
/// start of `bytes`, in order, and what is left after them.
fn statuses(mut bytes: &[u8]) -> (Vec<u16>, usize) {
    let mut found = Vec::new();
    while whole_response(bytes) {
        let split = bytes.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let head = Raw::parse(&bytes[..split]);
        let length: usize = head.header("content-length").unwrap().parse().unwrap();
        found.push(head.status);
        bytes = &bytes[split + length..];
    }
    (found, bytes.len())
}

/// Every HTTP/1 request is served by a hyper connection of its own (an idle keep-alive
/// connection then holds no buffers), which a client must not be able to tell: requests
/// sent in one write (pipelined) are each answered, in order, on a connection that stays
/// open without saying so; `Connection: close`, or HTTP/1.0 without `keep-alive`, closes
/// it after the answer; HTTP/1.0 with `keep-alive` keeps it.
#[tokio::test]
async fn keep_alive_pipelining_and_close_work_as_http_1_says() {
    let gw = gateway(100).await;
    let mut stream = connect(&gw).await;
    let health = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    stream.write_all(health.repeat(3).as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let read = tokio::time::timeout(LIMIT, async {
        let mut buf = [0u8; 4096];
        while statuses(&received).0.len() < 3 {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed after {:?}", statuses(&received));
            received.extend_from_slice(&buf[..n]);
        }
    });
    read.await.expect("three answers");
    assert_eq!(statuses(&received), (vec![200, 200, 200], 0));
    let first = Raw::parse(&received);
    assert_eq!(
        first.header("connection"),
        None,
        "kept alive without a word"
    );

    // Still open: one more, asking to close.
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let last = read_until_closed(&mut stream).await;
    assert_eq!(statuses(&last), (vec![200], 0));

    let mut old = connect(&gw).await;
    old.write_all(b"GET /health HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let answered = read_until_closed(&mut old).await;
    assert!(answered.starts_with(b"HTTP/1.0 200"), "{answered:?}");

    let mut old_kept = connect(&gw).await;
    for _ in 0..2 {
        old_kept
            .write_all(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            .await
            .unwrap();
        let answer = Raw::parse(&read_response(&mut old_kept).await);
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("connection"), Some("keep-alive"));
    }
}

/// A request whose body the gateway never reads (no route takes it) is answered and its
/// connection closed: the body's bytes are never read as the next request's head, even
/// when they look like one and come after the answer.
#[tokio::test]
async fn an_unread_body_is_never_taken_for_the_next_request() {
    let gw = gateway(100).await;
    let mut stream = connect(&gw).await;
    let hidden = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    let head = format!(
        "POST /no-such-path HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        hidden.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let answered = read_response(&mut stream).await;
    assert_eq!(statuses(&answered), (vec![404], 0));
    // The body, once the answer is out: the connection is closed, or closes unanswered.
    let _ = stream.write_all(hidden.as_bytes()).await;
    let after = read_until_closed(&mut stream).await;
    assert!(after.is_empty(), "{:?}", String::from_utf8_lossy(&after));
}

/// HTTP/2 with prior knowledge (told by its connection preface) is served too: several
/// requests multiplexed on one connection, a completion among them, each answered.
#[tokio::test]
async fn http2_with_prior_knowledge_is_served() {
    let gw = gateway(100).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let health = (0..3).map(|_| client.get(format!("{}/health", gw.url)).send());
    for answer in futures_util::future::join_all(health).await {
        let answer = answer.unwrap();
        assert_eq!(answer.version(), reqwest::Version::HTTP_2);
        assert_eq!(answer.status(), 200);
    }
    let completion = client
        .post(format!("{}/v1/completions", gw.url))
        .bearer_auth(&gw.key)
        .json(&serde_json::json!({"model": "llama-8b", "prompt": "Hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(completion.version(), reqwest::Version::HTTP_2);
    assert_eq!(completion.status(), 200);
    let body: serde_json::Value = completion.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 2, "{body}");
}

/// `fleetgate_idle_connections`, scraped on a connection of its own that is closed at
/// once (so it never counts itself). Polls until it is `want`, within [`LIMIT`].
async fn await_idle_connections(gw: &Gateway, want: f64) {
    let scraper = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let deadline = Instant::now() + LIMIT;
    loop {
        let text = scraper
            .get(format!("{}/metrics", gw.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let idle = parse_metrics(&text)
            .iter()
            .find(|s| s.name == "fleetgate_idle_connections")
            .map_or(0.0, |s| s.value);
        if idle == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "idle connections: {idle}, not {want}"
        );
        tokio::task::yield_now().await;
    }
}

/// A keep-alive connection quiet after its answer is handed back by hyper and waits for
/// the next request holding no buffers (counted as idle); that request is answered as on
/// any keep-alive connection. One whose last request body was not read closes instead.
#[tokio::test]
async fn a_quiet_keep_alive_connection_waits_without_buffers_and_serves_again() {
    let gw = Gateway::start_with(
        MockConfig::default(),
        "[connections]\nheader_read_timeout_ms = 20000\n",
    )
    .await;
    let mut stream = connect(&gw).await;
    let health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    for _ in 0..2 {
        stream.write_all(health).await.unwrap();
        let answer = Raw::parse(&read_response(&mut stream).await);
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("connection"), None);
        await_idle_connections(&gw, 1.0).await;
    }

    let mut unread = connect(&gw).await;
    unread
        .write_all(b"POST /no-such-path HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde")
        .await
        .unwrap();
    let answered = read_until_closed(&mut unread).await;
    assert_eq!(statuses(&answered), (vec![404], 0));
    // The first connection is still the only one waiting.
    await_idle_connections(&gw, 1.0).await;
    drop(stream);
    await_idle_connections(&gw, 0.0).await;
}

/// A stream that outlasts the quiet time (its head is out, nothing new begins) ends
/// whole, and the connection carries the next request: handing the socket back waits
/// for the answer under way.
#[tokio::test]
async fn a_stream_longer_than_the_quiet_time_ends_whole_and_the_connection_goes_on() {
    let gw = Gateway::start_slow(40).await;
    let mut stream = connect(&gw).await;
    let body = r#"{"model":"llama-8b","prompt":"Hi","max_tokens":25,"stream":true}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        gw.key,
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // 25 tokens at 40 ms: ~1 s, four times the quiet time. Chunked: read to its end.
    let mut received = Vec::new();
    let read = tokio::time::timeout(LIMIT, async {
        let mut buf = [0u8; 4096];
        while !received.ends_with(b"0\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed mid-stream: {:?}",
                String::from_utf8_lossy(&received)
            );
            received.extend_from_slice(&buf[..n]);
        }
    });
    read.await.expect("the whole stream");
    let text = String::from_utf8_lossy(&received);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(!text.to_lowercase().contains("connection: close"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");

    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(Raw::parse(&read_response(&mut stream).await).status, 200);
}
