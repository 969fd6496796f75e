//! The real binaries as child processes: started on port 0, their addresses read from
//! what they print, killed when the test ends however it ends.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const FLEETGATE: &str = env!("CARGO_BIN_EXE_fleetgate");
/// A started process prints its address within this.
const STARTUP: Duration = Duration::from_secs(30);

/// A child process that is killed when the test ends, however it ends.
pub struct Proc(pub Child);

/// Sends the signal `name` (`TERM`, `HUP`, `STOP`…) to `process` with `kill`.
pub fn signal(process: &Child, name: &str) {
    let sent = Command::new("kill")
        .args([format!("-{name}"), process.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{name}");
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads lines from a child's pipe on a thread (echoing them, tagged, to the test's
/// captured output) until `pred` picks one out; keeps draining the pipe afterwards.
pub fn wait_for_line(
    pipe: impl std::io::Read + Send + 'static,
    tag: String,
    pred: impl Fn(&str) -> Option<String> + Send + 'static,
) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            eprintln!("[{tag}] {line}");
            if let Some(found) = pred(&line) {
                let _ = tx.send(found);
            }
        }
    });
    rx.recv_timeout(STARTUP)
        .expect("the process printed the expected line")
}

/// A mock-vllm whose tokens come `token_delay_ms` apart, on a runtime and threads of its
/// own: a test blocked on a child process (or on a synchronous call) never stalls it.
/// Stopped when dropped.
pub struct MockNode {
    mock: Option<mock_vllm::MockVllm>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for MockNode {
    fn drop(&mut self) {
        drop(self.mock.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl MockNode {
    /// The prompts of the completion requests the node received, in arrival order.
    pub fn prompts(&self) -> Vec<String> {
        let Some(mock) = &self.mock else {
            return Vec::new();
        };
        mock.received()
            .into_iter()
            .filter(|r| r.path == "/v1/completions")
            .filter_map(|r| r.json()["prompt"].as_str().map(str::to_owned))
            .collect()
    }

    /// Completion requests running on the node now.
    pub fn in_flight(&self) -> usize {
        self.mock.as_ref().map_or(0, mock_vllm::MockVllm::in_flight)
    }

    /// Completion requests whose client went away before the answer ended.
    pub fn cancelled(&self) -> usize {
        self.mock.as_ref().map_or(0, mock_vllm::MockVllm::cancelled)
    }
}

pub fn start_mock(token_delay_ms: u64) -> (MockNode, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let config = mock_vllm::MockConfig {
        token_delay: Duration::from_millis(token_delay_ms),
        ..mock_vllm::MockConfig::default()
    };
    let (tx, rx) = mpsc::channel();
    runtime.spawn(async move {
        let _ = tx.send(mock_vllm::MockVllm::start(config).await);
    });
    let mock = rx.recv_timeout(STARTUP).unwrap().unwrap();
    let url = mock.url();
    let node = MockNode {
        mock: Some(mock),
        runtime: Some(runtime),
    };
    (node, url)
}

/// `fleetgate serve` on port 0; returns its base URL.
pub fn serve(config: &Path, tag: &str) -> (Proc, String) {
    let (proc, address) = serve_watching(config, tag, listening_address);
    (proc, format!("http://{address}"))
}

/// `fleetgate serve` on port 0, every line it logs shown to `watch` (as long as it
/// runs); returns once `watch` has picked something out of one, e.g. the address with
/// [`listening_address`].
pub fn serve_watching(
    config: &Path,
    tag: &str,
    watch: impl Fn(&str) -> Option<String> + Send + 'static,
) -> (Proc, String) {
    let mut child = Command::new(FLEETGATE)
        .args(["serve", "--config"])
        .arg(config)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let proc = Proc(child);
    let picked = wait_for_line(stderr, tag.to_owned(), watch);
    (proc, picked)
}

/// The address in `fleetgate serve`'s `fleetgate listening … address=…` log line.
pub fn listening_address(line: &str) -> Option<String> {
    logged_address(line, "fleetgate listening")
}

/// The `address=…` of a log line carrying `message`.
pub fn logged_address(line: &str, message: &str) -> Option<String> {
    if !line.contains(message) {
        return None;
    }
    let address = line.split("address=").nth(1)?.split_whitespace().next()?;
    Some(address.to_owned())
}
