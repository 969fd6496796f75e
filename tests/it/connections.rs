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
const LIMIT: Duration = Duration::from_secs(10);
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

async fn connect(gw: &Gateway) -> TcpStream {
    TcpStream::connect(gw.url.trim_start_matches("http://"))
        .await
        .unwrap()
}

/// Reads until the server closes the connection; returns what it sent.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
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
async fn refusals(gw: &Gateway, reason: &str) -> f64 {
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
async fn read_response(stream: &mut (impl AsyncReadExt + Unpin)) -> Vec<u8> {
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

/// A response as read off the socket: status and body.
struct Raw {
    status: u16,
    body: Vec<u8>,
}

impl Raw {
    fn parse(bytes: &[u8]) -> Self {
        let split = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no whole head in {:?}", String::from_utf8_lossy(bytes)));
        let head = std::str::from_utf8(&bytes[..split]).unwrap();
        let status = head.split(' ').nth(1).unwrap();
        Self {
            status: status.parse().unwrap(),
            body: bytes[split + 4..].to_vec(),
        }
    }
}

/// Header lines `X-Filler-{i}: {i}` for `i` in `0..n`.
fn filler_headers(n: usize) -> String {
    (0..n).map(|i| format!("X-Filler-{i}: {i}\r\n")).collect()
}

/// `prefix` and then `a`s, `len` bytes in all.
fn padded(prefix: &str, len: usize) -> String {
    prefix.to_owned() + &"a".repeat(len - prefix.len())
}

/// The limit on a request head (start line and headers) the README documents.
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
async fn a_request_head_over_the_limits_gets_431() {
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
    for request in over {
        let mut stream = connect(&gw).await;
        stream.write_all(request.as_bytes()).await.unwrap();
        let answer = Raw::parse(&read_until_closed(&mut stream).await);
        assert_eq!(answer.status, 431);
    }
}
