//! HTTPS on `listen` (`[tls]`), against the real `fleetgate serve` in front of a
//! mock-vllm, with a test CA: completions over HTTP/2 and HTTP/1.1 (told by ALPN), the
//! TLS handshake due like a request head, the certificate rotated by SIGHUP mid-load
//! without a failed request (issue #36), and a bad new certificate keeping the old.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

/// The parts of the shared harness (`tests/common`) these tests use.
mod common {
    pub mod cli;
    #[expect(
        dead_code,
        reason = "these tests read the server's log themselves, and ask the node nothing"
    )]
    pub mod processes;
}

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cli::create_key;
use common::processes::{
    FLEETGATE, MockNode, Proc, listening_address, serve_watching, signal, start_mock,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use reqwest::Version;
use reqwest::tls::TlsInfo;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How long anything polled here may take to come true.
const DEADLINE: Duration = Duration::from_secs(20);

/// A CA of the test's own, and certificates it issues for 127.0.0.1.
struct TestCa(CertifiedIssuer<'static, KeyPair>);

/// A certificate and its key, as PEM, and the certificate as the client sees it (DER).
struct Issued {
    cert_pem: String,
    key_pem: String,
    der: Vec<u8>,
}

impl TestCa {
    fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "fleetgate test CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Self(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    fn issue(&self) -> Issued {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.0).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }

    /// A client that trusts this CA only and keeps its connections: HTTP/2 when the
    /// server offers it by ALPN, unless `http1`.
    fn client(&self, http1: bool) -> reqwest::Client {
        let root = reqwest::Certificate::from_der(self.0.der()).unwrap();
        let builder = reqwest::Client::builder()
            .tls_certs_only([root])
            .tls_info(true);
        let builder = if http1 { builder.http1_only() } else { builder };
        builder.build().unwrap()
    }
}

/// Puts `cert` and `key` in place as certificate renewals do: each written beside, then
/// renamed over the file the server reads.
fn install(dir: &Path, cert: &str, key: &str) {
    for (name, pem) in [("cert.pem", cert), ("key.pem", key)] {
        let next = dir.join(format!("{name}.next"));
        std::fs::write(&next, pem).unwrap();
        std::fs::rename(&next, dir.join(name)).unwrap();
    }
}

/// A config serving HTTPS with `cert.pem` and `key.pem` of its own directory (named
/// relative to it).
fn write_config(dir: &Path, upstream: &str, connections: &str) -> PathBuf {
    let path = dir.join("fleetgate.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase_url = \"sqlite://{}/fg.db\"\n\n[connections]\n{connections}\n\n[tls]\ncert_file = \"cert.pem\"\nkey_file = \"key.pem\"\n\n[[models]]\nid = \"llama-8b\"\n\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n",
            dir.display()
        ),
    )
    .unwrap();
    path
}

/// `fleetgate serve`, with every line it logs kept.
struct Server {
    process: Proc,
    url: String,
    address: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(config: &Path) -> Self {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&log);
        let (process, address) = serve_watching(config, "fleetgate", move |line| {
            lines.lock().unwrap().push(line.to_owned());
            listening_address(line)
        });
        Self {
            process,
            url: format!("https://{address}"),
            address,
            log,
        }
    }

    /// Waits for a logged line holding every one of `parts`.
    async fn logged(&self, parts: &[&str]) -> String {
        let found = || {
            let log = self.log.lock().unwrap();
            log.iter()
                .find(|line| parts.iter().all(|part| line.contains(part)))
                .cloned()
        };
        let started = Instant::now();
        loop {
            if let Some(line) = found() {
                return line;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "no line logged with {parts:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A gateway serving HTTPS with a certificate of a test CA's, in front of a node whose
/// tokens come `token_delay_ms` apart, with `connections` in its `[connections]`.
struct Https {
    dir: tempfile::TempDir,
    ca: Arc<TestCa>,
    /// The certificate it started with.
    first: Issued,
    key: String,
    server: Server,
    _node: MockNode,
}

fn serve_https(token_delay_ms: u64, connections: &str) -> Https {
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(TestCa::new());
    let first = ca.issue();
    install(dir.path(), &first.cert_pem, &first.key_pem);
    let (node, upstream) = start_mock(token_delay_ms);
    let config = write_config(dir.path(), &upstream, connections);
    let key = create_key(&config, "tls");
    let server = Server::start(&config);
    Https {
        dir,
        ca,
        first,
        key,
        server,
        _node: node,
    }
}

/// The SHA-256 fingerprint of `der` as the log says it (`AB:CD:…`).
fn fingerprint(der: &[u8]) -> String {
    Sha256::digest(der)
        .iter()
        .map(|byte| format!("{byte:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// One completion answered whole.
struct Answer {
    version: Version,
    /// The certificate the server presented on the request's connection.
    certificate: Vec<u8>,
}

/// A completion, streamed or not, read to its end: an error says what went wrong.
async fn complete(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    stream: bool,
) -> Result<Answer, String> {
    let body = serde_json::json!({
        "model": "llama-8b", "prompt": "Hi", "max_tokens": if stream { 16 } else { 4 }, "stream": stream
    });
    let response = client
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("sending: {e:?}"))?;
    let (status, version) = (response.status(), response.version());
    let certificate = response
        .extensions()
        .get::<TlsInfo>()
        .and_then(TlsInfo::peer_certificate)
        .ok_or("no peer certificate")?
        .to_vec();
    let text = response
        .text()
        .await
        .map_err(|e| format!("reading: {e:?}"))?;
    if status != 200 {
        return Err(format!("{status}: {text}"));
    }
    if stream && !text.trim_end().ends_with("data: [DONE]") {
        return Err(format!("a stream cut short: {text}"));
    }
    Ok(Answer {
        version,
        certificate,
    })
}

#[tokio::test]
async fn completions_are_served_over_https_and_a_silent_client_is_closed() {
    let https = serve_https(0, "header_read_timeout_ms = 500");
    let ca = &https.ca;
    let issued = &https.first;
    let key = &https.key;
    let server = &https.server;
    server
        .logged(&["serving HTTPS", &fingerprint(&issued.der), "expires"])
        .await;

    for (http1, version) in [(false, Version::HTTP_2), (true, Version::HTTP_11)] {
        let answer = complete(&ca.client(http1), &server.url, key, false)
            .await
            .unwrap();
        assert_eq!(answer.version, version, "told by ALPN");
        assert_eq!(answer.certificate, issued.der);
    }

    // A client that opens the connection and sends nothing is closed when a request head
    // would be due: the handshake holds nothing longer.
    let mut silent = tokio::net::TcpStream::connect(&server.address)
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(DEADLINE, silent.read(&mut byte)).await;
    assert!(
        matches!(closed, Ok(Ok(0) | Err(_))),
        "closed, not {closed:?}"
    );
    // Plain HTTP on the HTTPS listener: no answer, a failed handshake.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/health", server.address))
        .send()
        .await;
    assert!(plain.is_err(), "{plain:?}");

    let client = ca.client(false);
    for reason in ["header_timeout", "tls_handshake"] {
        assert_eq!(refusals(&client, &server.url, reason).await, 1, "{reason}");
    }
}

#[tokio::test]
async fn a_connection_in_its_handshake_holds_its_place_under_the_caps() {
    let https = serve_https(0, "max_open_per_client = 1");
    let ca = &https.ca;
    let server = &https.server;
    // A client that connects and says nothing takes this address's one place...
    let silent = tokio::net::TcpStream::connect(&server.address)
        .await
        .unwrap();
    let client = ca.client(true);
    let health = format!("{}/health", server.url);
    let refused = client.get(&health).send().await;
    assert!(refused.is_err(), "{refused:?}");
    // ...until it goes.
    drop(silent);
    let started = Instant::now();
    while client.get(&health).send().await.is_err() {
        assert!(started.elapsed() < DEADLINE, "the place never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The same connection, kept alive: the only one this address may have.
    let refused = refusals(&client, &server.url, "max_open_per_client").await;
    assert!(refused >= 1, "the refused connection counted");
}

/// The server's `fleetgate_connection_refusals_total` for `reason`, scraped by `client`.
async fn refusals(client: &reqwest::Client, url: &str, reason: &str) -> u64 {
    let series = format!("fleetgate_connection_refusals_total{{reason=\"{reason}\"}}");
    metric(client, url, &series).await
}

/// The value of `series` (name and labels) in the server's `/metrics`.
async fn metric(client: &reqwest::Client, url: &str, series: &str) -> u64 {
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!("{series} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .unwrap_or_else(|| panic!("{series} in:\n{metrics}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn an_idle_https_keep_alive_connection_serves_its_next_request() {
    let https = serve_https(0, "");
    let ca = &https.ca;
    let server = &https.server;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.0.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(&server.address)
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    // No ALPN: HTTP/1.1, told by the first bytes.
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    let scraper = ca.client(false);
    for _ in 0..2 {
        tls.write_all(b"GET /live HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let response = read_response(&mut tls).await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        // Quiet after its answer, the connection is handed back by hyper and waits for
        // the next request, TLS and all.
        let started = Instant::now();
        while metric(&scraper, &server.url, "fleetgate_idle_connections").await != 1 {
            assert!(started.elapsed() < DEADLINE, "never idle");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One HTTP/1.1 response with a `Content-Length` body, read whole.
async fn read_response(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> String {
    let mut response = Vec::new();
    let whole = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes).to_lowercase();
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            return false;
        };
        head.lines()
            .find_map(|line| line.strip_prefix("content-length: "))
            .and_then(|n| n.trim().parse::<usize>().ok())
            .is_some_and(|n| body.len() >= n)
    };
    let mut buf = [0u8; 4096];
    while !whole(&response) {
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_ne!(n, 0, "closed before a whole response");
        response.extend_from_slice(&buf[..n]);
    }
    String::from_utf8(response).unwrap()
}

/// How a load worker connects.
#[derive(Clone, Copy, Debug)]
enum Connecting {
    /// One client, whose connection stays open throughout.
    KeepAlive { http1: bool, stream: bool },
    /// A new client, so a new connection and handshake, for each request.
    Fresh { http1: bool },
}

/// What one worker's requests came to.
#[derive(Default)]
struct Tally {
    /// Each answer's certificate, and whether the request began once the new one was
    /// seen served.
    answers: Vec<(bool, Vec<u8>)>,
    failures: Vec<String>,
}

impl Tally {
    fn after_rotation(&self) -> usize {
        self.answers.iter().filter(|(after, _)| *after).count()
    }
}

/// Requests one after another until `stop`.
async fn load(
    ca: Arc<TestCa>,
    connecting: Connecting,
    url: String,
    key: String,
    rotated: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
) {
    let (http1, stream, keep) = match connecting {
        Connecting::KeepAlive { http1, stream } => (http1, stream, true),
        Connecting::Fresh { http1 } => (http1, false, false),
    };
    let kept = ca.client(http1);
    while !stop.load(Ordering::Acquire) {
        let after = rotated.load(Ordering::Acquire);
        let fresh;
        let client = if keep {
            &kept
        } else {
            fresh = ca.client(http1);
            &fresh
        };
        let answer = complete(client, &url, &key, stream).await;
        let mut tally = tally.lock().unwrap();
        match answer {
            Ok(answer) => tally.answers.push((after, answer.certificate)),
            Err(err) => tally.failures.push(format!("{connecting:?}: {err}")),
        }
    }
}

/// Polls until `done` holds for every tally.
async fn until_each(what: &str, tallies: &[Arc<Mutex<Tally>>], done: impl Fn(&Tally) -> bool) {
    let started = Instant::now();
    while !tallies.iter().all(|t| done(&t.lock().unwrap())) {
        assert!(
            started.elapsed() < DEADLINE,
            "not within {DEADLINE:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_rotated_by_sighup_mid_load_fails_no_request() {
    // Tokens 5 ms apart: a streamed answer is under way for some 80 ms.
    let https = serve_https(5, "");
    let dir = &https.dir;
    let ca = &https.ca;
    let old = &https.first;
    let key = &https.key;
    let server = &https.server;
    let new = ca.issue();

    let (rotated, stop) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let workers = [
        Connecting::KeepAlive {
            http1: true,
            stream: false,
        },
        Connecting::KeepAlive {
            http1: false,
            stream: false,
        },
        Connecting::KeepAlive {
            http1: false,
            stream: true,
        },
        Connecting::KeepAlive {
            http1: true,
            stream: true,
        },
        Connecting::Fresh { http1: true },
        Connecting::Fresh { http1: false },
    ];
    let mut tallies = Vec::new();
    let mut running = Vec::new();
    for connecting in workers {
        let tally = Arc::new(Mutex::new(Tally::default()));
        tallies.push(Arc::clone(&tally));
        running.push(tokio::spawn(load(
            Arc::clone(ca),
            connecting,
            server.url.clone(),
            key.clone(),
            Arc::clone(&rotated),
            Arc::clone(&stop),
            tally,
        )));
    }
    until_each("five answers each before the rotation", &tallies, |t| {
        t.answers.len() >= 5
    })
    .await;

    install(dir.path(), &new.cert_pem, &new.key_pem);
    signal(&server.process.0, "HUP");
    // The new certificate is served once a new connection gets it.
    let started = Instant::now();
    loop {
        let answer = complete(&ca.client(true), &server.url, key, false)
            .await
            .unwrap();
        if answer.certificate == new.der {
            break;
        }
        assert_eq!(answer.certificate, old.der);
        assert!(
            started.elapsed() < DEADLINE,
            "the new certificate never served"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rotated.store(true, Ordering::Release);
    server
        .logged(&["TLS certificate reloaded", &fingerprint(&new.der)])
        .await;
    until_each("five answers each after the rotation", &tallies, |t| {
        t.after_rotation() >= 5
    })
    .await;
    stop.store(true, Ordering::Release);
    for worker in running {
        worker.await.unwrap();
    }

    for (connecting, tally) in workers.iter().zip(&tallies) {
        let tally = tally.lock().unwrap();
        eprintln!(
            "{connecting:?}: {} answers, {} begun once the new certificate was served, {} failed",
            tally.answers.len(),
            tally.after_rotation(),
            tally.failures.len()
        );
        assert_eq!(tally.failures, Vec::<String>::new(), "no request failed");
        for (after, certificate) in &tally.answers {
            let expected = match connecting {
                // Their connections, opened before, go on with the old certificate.
                Connecting::KeepAlive { .. } => &old.der,
                Connecting::Fresh { .. } if *after => &new.der,
                Connecting::Fresh { .. } => continue,
            };
            assert!(
                certificate == expected,
                "{connecting:?}: {} served, not {}",
                fingerprint(certificate),
                fingerprint(expected)
            );
        }
    }
}

#[tokio::test]
async fn a_bad_certificate_on_reload_keeps_the_one_served() {
    let https = serve_https(0, "");
    let dir = &https.dir;
    let ca = &https.ca;
    let served = &https.first;
    let key = &https.key;
    let server = &https.server;

    // A renewed certificate beside the old key, as when a renewal stopped half-way.
    let renewed = ca.issue();
    install(dir.path(), &renewed.cert_pem, &served.key_pem);
    signal(&server.process.0, "HUP");
    let line = server
        .logged(&[
            "TLS certificate not reloaded",
            "key.pem",
            "is not the key of",
        ])
        .await;
    assert!(line.contains(&fingerprint(&served.der)), "{line}");
    assert!(
        !line.contains(served.key_pem.lines().nth(1).unwrap()),
        "{line}"
    );
    // The key gone: the file is named.
    std::fs::remove_file(dir.path().join("key.pem")).unwrap();
    signal(&server.process.0, "HUP");
    server
        .logged(&["TLS certificate not reloaded", "cannot read the key file"])
        .await;

    for http1 in [false, true] {
        let answer = complete(&ca.client(http1), &server.url, key, false)
            .await
            .unwrap();
        assert_eq!(answer.certificate, served.der, "the old one still served");
    }
}

#[test]
fn a_certificate_that_cannot_be_used_stops_the_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let (cert, other) = (ca.issue(), ca.issue());
    install(dir.path(), &cert.cert_pem, &other.key_pem);
    let config = write_config(dir.path(), "http://127.0.0.1:9", "");
    let mut child = Proc(
        std::process::Command::new(FLEETGATE)
            .args(["serve", "--config"])
            .arg(&config)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < DEADLINE, "still running");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut said = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut said).unwrap();
    assert!(!status.success());
    assert!(
        said.contains("key.pem is not the key of the certificate in") && said.contains("cert.pem"),
        "{said}"
    );
    assert!(
        !dir.path().join("fg.db").exists(),
        "stopped before the store was opened"
    );
}
