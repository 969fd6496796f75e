//! Connections one client could use to lock others out (issue #33, "Connections"): an
//! HTTP/2 connection that never sends a request or stops answering pings, a body
//! trickled to a route other than `/v1/completions`, a body over the limit there, and
//! idle or surplus connections to the ops listener. Each is let go or answered as
//! documented, within the configured time-outs and caps.

use std::time::{Duration, Instant};

use mock_vllm::MockConfig;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::common::h2::{h2_frame, h2_preface};
use crate::common::{Gateway, expect_error};
use crate::connections::{LIMIT, Raw, connect, read_response, read_until_closed, refusals};

/// The short time-out (header, and body unless a test needs it long) of these tests.
const TIMEOUT_MS: u64 = 300;

/// A gateway with `header_read_timeout_ms` [`TIMEOUT_MS`], `body_read_timeout_ms`
/// `body_ms`, and `extra` (top-level keys, then more `[connections]` keys).
async fn gateway(body_ms: u64, top_level: &str, connections: &str) -> Gateway {
    Gateway::start_with(
        MockConfig::default(),
        &format!(
            "{top_level}\n[connections]\nheader_read_timeout_ms = {TIMEOUT_MS}\nbody_read_timeout_ms = {body_ms}\n{connections}\n"
        ),
    )
    .await
}

/// The frames in what an HTTP/2 server sent: (type, flags, stream) of each.
fn h2_frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32)> {
    let mut frames = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff;
        frames.push((bytes[3], bytes[4], stream));
        bytes = &bytes[(9 + len).min(bytes.len())..];
    }
    frames
}

/// An HPACK integer with a `prefix`-bit prefix, its first byte's other bits `flags`
/// (RFC 7541 5.1).
fn hpack_int(flags: u8, prefix: u32, value: usize, out: &mut Vec<u8>) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A header whose name is entry `index` of HPACK's static table, as a literal without
/// indexing (RFC 7541 6.2.2), its value not Huffman-coded.
fn hpack_field(index: usize, value: &str, out: &mut Vec<u8>) {
    hpack_int(0, 4, index, out);
    hpack_int(0, 7, value.len(), out);
    out.extend(value.as_bytes());
}

/// A HEADERS frame on stream 1 opening `POST /v1/completions` with `key`, its body to
/// follow (no END_STREAM): a request the server waits on.
fn h2_completion_head(key: &str) -> Vec<u8> {
    // :method POST (static entry 3) and :scheme http (6), indexed.
    let mut block = vec![0x83, 0x86];
    hpack_field(4, "/v1/completions", &mut block); // :path
    hpack_field(1, "localhost", &mut block); // :authority
    hpack_field(23, &format!("Bearer {key}"), &mut block); // authorization
    hpack_field(31, "application/json", &mut block); // content-type
    h2_frame(0x1, 0x4, 1, &block) // END_HEADERS
}

/// A HEADERS frame on stream 1 that is a whole `GET /health` (END_HEADERS, END_STREAM).
fn h2_health() -> Vec<u8> {
    // :method GET (static entry 2) and :scheme http (6), indexed.
    let mut block = vec![0x82, 0x86];
    hpack_field(4, "/health", &mut block); // :path
    hpack_field(1, "localhost", &mut block); // :authority
    h2_frame(0x1, 0x5, 1, &block)
}

/// The gateway's `ops_listen` address: a port free a moment ago.
pub(crate) async fn free_address() -> String {
    let probe = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    probe.local_addr().unwrap().to_string()
}

/// A connection to `address`, once the gateway listens there (it binds the ops
/// listener while starting up, after the test has its handle).
pub(crate) async fn connect_to(address: &str) -> TcpStream {
    let connected = tokio::time::timeout(LIMIT, async {
        loop {
            if let Ok(stream) = TcpStream::connect(address).await {
                return stream;
            }
            tokio::task::yield_now().await;
        }
    });
    connected.await.expect("the ops listener is up")
}

/// A `GET /health` on `stream`, answered 200 (the connection is being served).
async fn health(stream: &mut TcpStream) {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_response(stream).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}

/// An HTTP/2 connection that sends its preface and settings and then nothing holds no
/// socket past the header time-out, as an HTTP/1 one does not; nor does one that goes
/// idle after a request.
#[tokio::test]
async fn an_http2_connection_that_sends_no_request_is_closed_when_its_head_is_due() {
    let gw = gateway(TIMEOUT_MS, "", "").await;
    let mut silent = connect(&gw).await;
    silent.write_all(&h2_preface()).await.unwrap();
    let opened = Instant::now();
    read_until_closed(&mut silent).await;
    assert!(opened.elapsed() >= Duration::from_millis(TIMEOUT_MS - 50));

    let mut idle = connect(&gw).await;
    let mut sent = h2_preface();
    sent.extend(h2_health());
    idle.write_all(&sent).await.unwrap();
    let received = read_until_closed(&mut idle).await;
    // The answer's HEADERS frame (type 1) on stream 1 came before the close.
    let frames = h2_frames(&received);
    assert!(frames.contains(&(0x1, 0x4, 1)), "no answer in {frames:?}");
    // Both closed for idling (a ping left unanswered would not count).
    assert_eq!(refusals(&gw, "header_timeout").await, 2.0);
}

/// A peer that stops answering HTTP/2 pings (gone, or holding the connection on
/// purpose) is dropped, even with a request open on it: here one whose body never
/// comes, with a body time-out far beyond the test.
#[tokio::test]
async fn an_http2_peer_that_stops_answering_pings_is_dropped() {
    let gw = gateway(60_000, "", "").await;
    let mut stream = connect(&gw).await;
    let mut sent = h2_preface();
    sent.extend(h2_completion_head(&gw.key));
    stream.write_all(&sent).await.unwrap();
    let received = read_until_closed(&mut stream).await;
    // The server's pings (type 6, not an ACK) are among what it sent.
    let frames = h2_frames(&received);
    assert!(frames.contains(&(0x6, 0, 0)), "no ping in {frames:?}");
    assert!(gw.upstream_completions().is_empty());
}

/// A body trickled to a Workbench route gets 408 in the envelope, as on
/// `/v1/completions`, instead of holding the request until the client is done.
#[tokio::test]
async fn a_body_trickled_to_a_workbench_route_gets_408_in_the_envelope() {
    let gw = gateway(TIMEOUT_MS, "", "").await;
    let body = format!(
        r#"{{"kind":"prompt","title":"trickled","content":{{"prompt":"{}"}}}}"#,
        "a".repeat(40)
    );
    let (mut reader, mut writer) = connect(&gw).await.into_split();
    let head = format!(
        "POST /v1/workbench/items HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        gw.key,
        body.len()
    );
    writer.write_all(head.as_bytes()).await.unwrap();
    // One byte every 50 ms (the whole body would take about 5 s), until answered.
    let trickle = tokio::spawn(async move {
        for byte in body.bytes() {
            if writer.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let answer = Raw::parse(&read_response(&mut reader).await);
    trickle.abort();
    answer.envelope(408, "request_timeout", "invalid_request_error");
    let items = gw
        .client
        .get(format!("{}/v1/workbench/items", gw.url))
        .bearer_auth(&gw.key)
        .send()
        .await
        .unwrap();
    let items: serde_json::Value = items.json().await.unwrap();
    assert_eq!(items["data"], serde_json::json!([]), "nothing was saved");
}

/// A Workbench body over its 2 MiB limit is 413 `request_too_large`, not retryable, as
/// documented for every body over its limit.
#[tokio::test]
async fn a_body_over_the_limit_on_a_workbench_route_gets_413() {
    let gw = gateway(10_000, "", "").await;
    let start = r#"{"kind":"prompt","title":"big","content":{"prompt":""#;
    let end = r#""}}"#;
    let filler = "a".repeat(2 * 1024 * 1024 + 1 - start.len() - end.len());
    let body = format!("{start}{filler}{end}");
    let (mut reader, mut writer) = connect(&gw).await.into_split();
    let head = format!(
        "POST /v1/workbench/items HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        gw.key,
        body.len()
    );
    // Written apart: the server may answer before it has read the body.
    let send = tokio::spawn(async move {
        let _ = writer.write_all(head.as_bytes()).await;
        let _ = writer.write_all(body.as_bytes()).await;
    });
    let answer = Raw::parse(&read_response(&mut reader).await);
    send.abort();
    answer.envelope(413, "request_too_large", "invalid_request_error");
    assert_eq!(answer.header("x-should-retry"), Some("false"));
    assert_eq!(answer.header("connection"), Some("close"), "not reused");

    // A client that sends its whole body before it reads (as most do) gets the answer
    // too, rather than a broken pipe from a socket closed under its upload.
    for megabytes in [3, 4, 3, 4] {
        let prompt = "a".repeat(megabytes * 1024 * 1024);
        let response = gw
            .client
            .post(format!("{}/v1/workbench/items", gw.url))
            .bearer_auth(&gw.key)
            .json(&serde_json::json!({"kind": "prompt", "content": {"prompt": prompt}}))
            .send();
        let response = tokio::time::timeout(LIMIT, response)
            .await
            .expect("an answer");
        let response = response.unwrap_or_else(|err| panic!("{megabytes} MiB: {err:?}"));
        expect_error(response, 413, "request_too_large").await;
    }
}

/// A connection to the ops listener that sends nothing is closed when its head is due,
/// as on the API listener.
#[tokio::test]
async fn an_idle_connection_to_the_ops_listener_is_closed_when_its_head_is_due() {
    let ops = free_address().await;
    let _gw = gateway(TIMEOUT_MS, &format!("ops_listen = \"{ops}\""), "").await;
    let mut idle = connect_to(&ops).await;
    assert!(read_until_closed(&mut idle).await.is_empty());
    // Kept alive after an answer, then idle.
    let mut kept = connect_to(&ops).await;
    health(&mut kept).await;
    read_until_closed(&mut kept).await;
}

/// The ops listener has a cap of its own: connections beyond it are closed at once,
/// and the API listener goes on serving.
#[tokio::test]
async fn connections_to_the_ops_listener_beyond_its_cap_are_closed_at_once() {
    let ops = free_address().await;
    let gw = Gateway::start_with(
        MockConfig::default(),
        &format!("ops_listen = \"{ops}\"\n[connections]\nops_max_open = 2\n"),
    )
    .await;
    let mut held = [connect_to(&ops).await, connect_to(&ops).await];
    for stream in &mut held {
        health(stream).await;
    }
    let mut beyond = connect_to(&ops).await;
    let refused_at = Instant::now();
    assert!(read_until_closed(&mut beyond).await.is_empty(), "no answer");
    assert!(
        refused_at.elapsed() < Duration::from_secs(5),
        "closed at once, not by the head time-out (60 s)"
    );
    let api = gw.get("/health").send().await.unwrap();
    assert_eq!(api.status(), 200);
    assert!(refusals(&gw, "max_open").await >= 1.0);
}

/// With `max_open_per_client`, one address cannot hold more connections than that: the
/// next is closed at once, and a place comes free when one of its connections closes.
#[tokio::test]
async fn connections_from_one_client_beyond_its_cap_are_closed_at_once() {
    let gw = Gateway::start_with(
        MockConfig::default(),
        "[connections]\nmax_open_per_client = 2\n",
    )
    .await;
    let mut held = [connect(&gw).await, connect(&gw).await];
    for stream in &mut held {
        health(stream).await;
    }
    let mut beyond = connect(&gw).await;
    let refused_at = Instant::now();
    assert!(read_until_closed(&mut beyond).await.is_empty(), "no answer");
    assert!(
        refused_at.elapsed() < Duration::from_secs(5),
        "closed at once, not by the head time-out (60 s)"
    );
    // Once the server has seen one of them close, its place is free again.
    let [first, _second] = held;
    drop(first);
    let served = tokio::time::timeout(LIMIT, async {
        loop {
            let mut again = connect(&gw).await;
            let _ = again
                .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                .await;
            if !read_response(&mut again).await.is_empty() {
                return;
            }
        }
    });
    served.await.expect("a connection is served again");
}

/// The head of a completion of `length` bytes from `key`, asking to be told (`100
/// Continue`) once the gateway reads its body.
fn upload_head(key: &str, length: usize) -> String {
    format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
    )
}

/// Reads until the gateway's interim answer to `Expect: 100-continue` has come: it is
/// reading the body now.
async fn continued(stream: &mut TcpStream) {
    let mut head = Vec::new();
    let read = tokio::time::timeout(LIMIT, async {
        let mut buf = [0u8; 256];
        while !head.ends_with(b"\r\n\r\n") {
            let n = tokio::io::AsyncReadExt::read(stream, &mut buf)
                .await
                .unwrap();
            assert!(n > 0, "closed before 100 Continue");
            head.extend_from_slice(&buf[..n]);
        }
    });
    read.await.expect("an interim answer");
    assert!(
        head.starts_with(b"HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&head)
    );
}

/// One key's many slow uploads cannot take the process's memory: once its bodies being
/// read hold `reading_bytes_per_key`, its next one is 429 `queue_full` before a byte of
/// it is read; another key's uploads go on, and the bound frees as uploads end.
#[tokio::test]
async fn a_keys_bodies_being_read_at_once_are_bounded() {
    let gw = gateway(10_000, "", "reading_bytes_per_key = 100000").await;
    // An upload of 60 kB, its body being waited for (the gateway said 100 Continue).
    let mut slow = connect(&gw).await;
    slow.write_all(upload_head(&gw.key, 60_000).as_bytes())
        .await
        .unwrap();
    continued(&mut slow).await;
    let mut second = connect(&gw).await;
    second
        .write_all(upload_head(&gw.key, 60_000).as_bytes())
        .await
        .unwrap();
    let refused = Raw::parse(&read_response(&mut second).await);
    refused.envelope(429, "queue_full", "rate_limit_error");
    assert!(refused.header("retry-after").is_some());
    // Another key is not held back by this one's uploads.
    let (_, other) = gw
        .create_key(fleetgate::store::LimitOverrides::default())
        .await;
    let mut theirs = connect(&gw).await;
    theirs
        .write_all(upload_head(&other, 60_000).as_bytes())
        .await
        .unwrap();
    continued(&mut theirs).await;
    // The slow upload gone, the key's next one is read.
    drop(slow);
    let body = r#"{"model":"llama-8b","prompt":[1,2],"max_tokens":1}"#;
    let read_again = tokio::time::timeout(LIMIT, async {
        loop {
            let response = gw.complete(body).send().await.unwrap();
            if response.status() == 200 {
                return;
            }
            expect_error(response, 429, "queue_full").await;
        }
    });
    read_again
        .await
        .expect("the key's bound freed once its upload was gone");
}
