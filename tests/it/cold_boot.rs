//! Scale to zero, end to end: a request for a model whose nodes are all down wakes it
//! through its wake hook. Once the hook confirms, a model whose checkpoint is known
//! gets an immediate 200 and keep-alive bytes until the node answers (or the error in
//! the body, the "200*" case); one never seen up is held without a byte until it has
//! booted. Refusals come before the wake; concurrent requests share one boot; the
//! keep-warm policy puts an idle model to sleep through its sleep hook.
//!
//! The hooks are a small HTTP server in the test: `POST /wake` and `POST /sleep`
//! control the mock node (reopen it, refuse connections) and count their calls.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{self, CHECKPOINT, Gateway, MODEL, expect_error};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use fleetgate::store::LimitOverrides;
use mock_vllm::{FailureMode, MockConfig, MockVllm};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Bound on every wait in this file: a test fails rather than hangs.
const WAIT: Duration = Duration::from_secs(20);
const PROBE_INTERVAL_MS: u64 = 50;
const KEEPALIVE_INTERVAL_MS: u64 = 50;
const BOOTING: &str = ": booting\n\n";

async fn bounded<T>(what: &str, work: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, work)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

// ---------------------------------------------------------------------------------
// The wake and sleep hooks.

/// What `POST /wake` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnWake {
    /// Reopens the node, then confirms (202): a boot that works.
    Boot,
    /// Confirms (202) but leaves the node down: the test brings it up itself, or never.
    ConfirmOnly,
    /// Answers 500: no boot was started.
    Fail,
}

struct HookState {
    node: MockVllm,
    on_wake: OnWake,
    wakes: watch::Sender<usize>,
    /// When each `POST /sleep` arrived.
    sleeps: watch::Sender<Vec<Instant>>,
}

struct Hooks {
    url: String,
    state: Arc<HookState>,
    server: JoinHandle<()>,
}

impl Hooks {
    async fn start(node: MockVllm, on_wake: OnWake) -> Self {
        let state = Arc::new(HookState {
            node,
            on_wake,
            wakes: watch::Sender::new(0),
            sleeps: watch::Sender::new(Vec::new()),
        });
        let app = Router::new()
            .route("/wake", post(wake))
            .route("/sleep", post(sleep))
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, state, server }
    }

    fn wakes(&self) -> usize {
        *self.state.wakes.borrow()
    }

    fn sleeps(&self) -> Vec<Instant> {
        self.state.sleeps.borrow().clone()
    }

    async fn wait_wakes(&self, n: usize) {
        let mut wakes = self.state.wakes.subscribe();
        bounded("the wake hook is called", wakes.wait_for(|&w| w >= n))
            .await
            .unwrap();
    }

    /// Waits for the `n`-th sleep call and returns when it arrived.
    async fn wait_sleep(&self, n: usize) -> Instant {
        let mut sleeps = self.state.sleeps.subscribe();
        let sleeps = bounded(
            "the sleep hook is called",
            sleeps.wait_for(|s| s.len() >= n),
        )
        .await
        .unwrap();
        sleeps[n - 1]
    }
}

impl Drop for Hooks {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn wake(State(hooks): State<Arc<HookState>>) -> StatusCode {
    hooks.wakes.send_modify(|n| *n += 1);
    match hooks.on_wake {
        OnWake::Boot => {
            hooks.node.set_failure(FailureMode::None);
            StatusCode::ACCEPTED
        }
        OnWake::ConfirmOnly => StatusCode::ACCEPTED,
        OnWake::Fail => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

async fn sleep(State(hooks): State<Arc<HookState>>) -> StatusCode {
    hooks.node.set_failure(FailureMode::Refuse);
    hooks.sleeps.send_modify(|s| s.push(Instant::now()));
    StatusCode::OK
}

// ---------------------------------------------------------------------------------
// A gateway with a wake hook, in front of one mock node.

struct Setup {
    on_wake: OnWake,
    /// The node is down when the gateway starts: the model's checkpoint is never learned.
    down_at_start: bool,
    boot_timeout_ms: u64,
    request_window_ms: u64,
    /// With a sleep hook: `(idle_sleep_ms, keep_warm_ms)`.
    keep_warm: Option<(u64, u64)>,
}

impl Setup {
    /// The defaults, with this wake hook.
    fn waking(on_wake: OnWake) -> Self {
        Self {
            on_wake,
            ..Self::default()
        }
    }
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            on_wake: OnWake::Boot,
            down_at_start: false,
            boot_timeout_ms: 10_000,
            request_window_ms: 600_000,
            keep_warm: None,
        }
    }
}

async fn start(setup: Setup) -> (Gateway, Hooks) {
    let node = common::node(MockConfig::default()).await;
    if setup.down_at_start {
        node.set_failure(FailureMode::Refuse);
    }
    let hooks = Hooks::start(node.clone(), setup.on_wake).await;
    let sleep = setup
        .keep_warm
        .map_or_else(String::new, |(idle_sleep_ms, keep_warm_ms)| {
            format!(
                "sleep_url = \"{}/sleep\"\nidle_sleep_ms = {idle_sleep_ms}\nkeep_warm_ms = {keep_warm_ms}",
                hooks.url
            )
        });
    // A short back-off cap: a node that failed probes while it booted is re-admitted
    // within a few probe intervals of coming up.
    let fleet = format!(
        "[fleet]
probe_interval_ms = {PROBE_INTERVAL_MS}
probe_timeout_ms = 200
eject_base_ms = 100
eject_max_ms = 200
keepalive_interval_ms = {KEEPALIVE_INTERVAL_MS}
request_window_ms = {window}",
        window = setup.request_window_ms,
    );
    let model = format!(
        "wake_url = \"{hooks}/wake\"
boot_timeout_ms = {boot}
{sleep}",
        hooks = hooks.url,
        boot = setup.boot_timeout_ms,
    );
    let gw = Gateway::start_fleet(&fleet, &model, &[(&node, "gpu-a", "")]).await;
    (gw, hooks)
}

/// [`start`], then the model is put to sleep the hard way ([`take_node_down`]).
async fn start_asleep(setup: Setup) -> (Gateway, Hooks) {
    let (gw, hooks) = start(setup).await;
    take_node_down(&gw).await;
    (gw, hooks)
}

/// Waits until `/metrics` shows the node as `up` (1) or not (0).
async fn wait_node_up(gw: &Gateway, up: u8) {
    let series = format!(r#"fleetgate_upstream_up{{model="{MODEL}",gpu="gpu-a"}} {up}"#);
    bounded(&format!("/metrics shows {series}"), async {
        loop {
            let metrics = gw.metrics_text().await;
            if metrics.lines().any(|line| line == series) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Puts a model whose checkpoint the gateway knows to sleep the hard way: its only
/// node goes down, and the prober ejects it.
async fn take_node_down(gw: &Gateway) {
    gw.mock.set_failure(FailureMode::Refuse);
    wait_node_up(gw, 0).await;
}

// ---------------------------------------------------------------------------------
// Requests and what comes back.

fn json_body() -> String {
    json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5}).to_string()
}

fn stream_body() -> String {
    json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "stream": true}).to_string()
}

/// Sends [`json_body`] as `workload` traffic (`X-Acs-Workload`) and expects a 200: when
/// it was asked, and the response.
async fn answered_as(gw: &Gateway, workload: &str) -> (Instant, reqwest::Response) {
    let what = format!("the {workload} answer");
    let asked = Instant::now();
    let response = bounded(
        &what,
        gw.complete(&json_body())
            .header("x-acs-workload", workload)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    (asked, response)
}

/// Sends a text prompt without `max_tokens` (planning needs the node's tokenizer), which
/// wakes the model. A bounded negative check: for six keep-alive intervals after the
/// hook confirmed, no response (not even its headers) arrives. Then the node comes up;
/// the answer is a 200.
async fn held_until_booted(gw: &Gateway, hooks: &Hooks) -> reqwest::Response {
    let body = json!({"model": MODEL, "prompt": "The capital of France is"}).to_string();
    let mut request = tokio::spawn(gw.complete(&body).send());
    hooks.wait_wakes(1).await;
    let quiet = Duration::from_millis(6 * KEEPALIVE_INTERVAL_MS);
    assert!(
        tokio::time::timeout(quiet, &mut request).await.is_err(),
        "answered before the node was up"
    );

    gw.mock.set_failure(FailureMode::None);
    let response = bounded("the answer", request).await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    response
}

/// Asserts a committed 200 of the cold path (no upstream error kind in the headers)
/// and returns its request id.
fn committed(response: &reqwest::Response, content_type: &str) -> String {
    assert_eq!(response.status(), 200);
    let headers = response.headers();
    assert_eq!(headers["content-type"], content_type);
    assert!(
        headers.get("x-acs-upstream-error-kind").is_none(),
        "{headers:?}"
    );
    headers["x-request-id"].to_str().unwrap().to_owned()
}

/// Sends `request` and asserts a committed 200 of the cold path (see [`committed`]):
/// the response and its request id.
async fn send_committed(
    request: reqwest::RequestBuilder,
    content_type: &str,
) -> (reqwest::Response, String) {
    let response = bounded("the 200", request.send()).await.unwrap();
    let request_id = committed(&response, content_type);
    (response, request_id)
}

/// Reads body chunks into `body` until `done(body)`.
async fn read_until(
    response: &mut reqwest::Response,
    body: &mut Vec<u8>,
    done: impl Fn(&[u8]) -> bool,
) {
    bounded("the body", async {
        while !done(body) {
            let chunk = response
                .chunk()
                .await
                .unwrap()
                .expect("the body ended early");
            body.extend_from_slice(&chunk);
        }
    })
    .await;
}

async fn read_to_end(response: &mut reqwest::Response, body: &mut Vec<u8>) {
    bounded("the end of the body", async {
        while let Some(chunk) = response.chunk().await.unwrap() {
            body.extend_from_slice(&chunk);
        }
    })
    .await;
}

/// The whole body.
async fn read_all(mut response: reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    read_to_end(&mut response, &mut body).await;
    body
}

fn spaces(body: &[u8]) -> usize {
    assert!(
        body.iter().all(|&b| b == b' '),
        "only keep-alive spaces so far: {:?}",
        String::from_utf8_lossy(body)
    );
    body.len()
}

fn booting_comments(body: &[u8]) -> usize {
    let text = std::str::from_utf8(body).unwrap();
    assert!(
        text.split_inclusive("\n\n").all(|line| line == BOOTING),
        "only keep-alive comments so far: {text:?}"
    );
    text.matches(BOOTING).count()
}

/// A JSON body after keep-alives: the number of leading spaces, and the JSON (which
/// parses as is, whitespace and all).
fn parse_json(body: &[u8]) -> (usize, Value) {
    let leading = body.iter().take_while(|&&b| b == b' ').count();
    let json = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "{e}: not whitespace + JSON: {:?}",
            String::from_utf8_lossy(body)
        )
    });
    (leading, json)
}

/// An SSE body after keep-alives: the number of `: booting` comments before the first
/// event, and the data of every event (`[DONE]` last).
fn parse_sse(body: &[u8]) -> (usize, Vec<String>) {
    let text = std::str::from_utf8(body).unwrap();
    let first_event = text
        .find("data: ")
        .unwrap_or_else(|| panic!("no event: {text:?}"));
    let (comments, events) = text.split_at(first_event);
    let comments = booting_comments(comments.as_bytes());
    assert!(events.ends_with("\n\n"), "{events:?}");
    let data = events
        .split_terminator("\n\n")
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?} in {text:?}"))
                .to_owned()
        })
        .collect();
    (comments, data)
}

fn assert_completion(json: &Value) {
    assert_eq!(json["object"], "text_completion", "{json}");
    assert_eq!(json["model"], CHECKPOINT, "{json}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{json}");
    assert_eq!(json["usage"]["completion_tokens"], 5, "{json}");
}

/// The stream's events are completion chunks, then `[DONE]`.
fn assert_completion_events(events: &[String]) {
    let (done, chunks) = events.split_last().expect("events");
    assert_eq!(done, "[DONE]");
    assert!(!chunks.is_empty());
    for chunk in chunks {
        let json: Value = serde_json::from_str(chunk).unwrap();
        assert_eq!(json["object"], "text_completion", "{json}");
        assert!(json.get("error").is_none(), "{json}");
    }
}

/// The error envelope as the 200's body: `{"error":{code,message,type},"request_id"}`.
fn assert_error_envelope(json: &Value, code: &str, request_id: &str) {
    assert_eq!(json["error"]["code"], code, "{json}");
    assert_eq!(json["error"]["type"], "server_error", "{json}");
    assert!(
        json["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{json}"
    );
    assert_eq!(json["request_id"], request_id, "{json}");
}

/// Nothing charged, reserved or running for the key.
async fn assert_nothing_charged(gw: &Gateway, key: &str) {
    let usage = gw.usage(key).await;
    assert_eq!(usage["used"], 0, "{usage}");
    assert_eq!(usage["reserved"], 0, "{usage}");
    assert_eq!(usage["running"], 0, "{usage}");
}

// ---------------------------------------------------------------------------------
// A model whose checkpoint is known: 200 at once, keep-alives, then the answer.

#[tokio::test]
async fn a_known_model_answers_200_at_once_and_sends_spaces_until_its_node_is_up() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::ConfirmOnly)).await;

    let (mut response, _) = send_committed(gw.complete(&json_body()), "application/json").await;
    assert_eq!(hooks.wakes(), 1);
    // The node is still down: two keep-alive spaces arrive while it is.
    let mut body = Vec::new();
    read_until(&mut response, &mut body, |b| spaces(b) >= 2).await;
    assert!(gw.upstream_completions().is_empty());

    gw.mock.set_failure(FailureMode::None);
    read_to_end(&mut response, &mut body).await;
    let (leading, json) = parse_json(&body);
    assert!(leading >= 2);
    assert_completion(&json);
    assert_eq!(gw.upstream_completions().len(), 1);
    assert_eq!(hooks.wakes(), 1);
    // Charged like any request: 3 prompt + 5 completion tokens.
    let usage = gw.usage(&gw.key).await;
    assert_eq!(usage["used"], 8, "{usage}");
}

#[tokio::test]
async fn a_booting_stream_gets_sse_comments_then_its_events() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::ConfirmOnly)).await;

    let (mut response, _) = send_committed(gw.complete(&stream_body()), "text/event-stream").await;
    let mut body = Vec::new();
    read_until(&mut response, &mut body, |b| booting_comments(b) >= 2).await;
    assert!(gw.upstream_completions().is_empty());

    gw.mock.set_failure(FailureMode::None);
    read_to_end(&mut response, &mut body).await;
    let (comments, events) = parse_sse(&body);
    assert!(comments >= 2);
    assert_completion_events(&events);
    assert_eq!(hooks.wakes(), 1);
}

// ---------------------------------------------------------------------------------
// A model never seen up: held without a byte until it has booted.

#[tokio::test]
async fn a_model_never_seen_up_is_held_without_a_byte_until_it_has_booted() {
    let (gw, hooks) = start(Setup {
        down_at_start: true,
        ..Setup::waking(OnWake::ConfirmOnly)
    })
    .await;
    let response = held_until_booted(&gw, &hooks).await;
    assert_eq!(response.headers()["x-acs-upstream-gpu"], "gpu-a");
    let body = response.bytes().await.unwrap();
    assert_eq!(body.first(), Some(&b'{'), "no keep-alive bytes");
    let json: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["object"], "text_completion");
    assert_eq!(json["model"], CHECKPOINT);
    // The default max_tokens was counted with the booted node's tokenizer.
    let sent = &gw.upstream_completions()[0];
    let max_tokens = sent["max_tokens"].as_u64().unwrap();
    assert!((8100..8192).contains(&max_tokens), "{sent}");
    assert_eq!(hooks.wakes(), 1);
}

#[tokio::test]
async fn a_known_model_whose_prompt_must_be_counted_is_woken_and_held_until_booted() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::ConfirmOnly)).await;
    // Known checkpoint, but a text prompt without max_tokens needs the tokenizer: the
    // request wakes the model and waits for it before anything is sent.
    let response = held_until_booted(&gw, &hooks).await;
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["object"], "text_completion");
    assert_eq!(hooks.wakes(), 1);
}

// ---------------------------------------------------------------------------------
// The "200*" case: the boot or the node fails after the 200 was committed.

#[tokio::test]
async fn a_boot_that_never_completes_puts_the_error_in_the_200_body() {
    let (gw, hooks) = start_asleep(Setup {
        boot_timeout_ms: 1_000,
        ..Setup::waking(OnWake::ConfirmOnly)
    })
    .await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;

    // Both at once: the second joins the boot the first started.
    let (json_response, stream_response) = bounded(
        "two 200s",
        futures_util::future::join(
            gw.complete_as(&key, &json_body()).send(),
            gw.complete(&stream_body()).send(),
        ),
    )
    .await;
    let json_response = json_response.unwrap();
    let json_id = committed(&json_response, "application/json");
    let stream_response = stream_response.unwrap();
    let stream_id = committed(&stream_response, "text/event-stream");

    let body = read_all(json_response).await;
    let (leading, json) = parse_json(&body);
    assert!(leading >= 2, "keep-alives while waiting");
    assert_error_envelope(&json, "upstream_unavailable", &json_id);

    let body = read_all(stream_response).await;
    let (comments, events) = parse_sse(&body);
    assert!(comments >= 2, "keep-alives while waiting");
    assert_eq!(events.len(), 2, "{events:?}");
    let error: Value = serde_json::from_str(&events[0]).unwrap();
    assert_error_envelope(&error, "upstream_unavailable", &stream_id);
    assert_eq!(events[1], "[DONE]");

    // One boot for both; nothing reached a node, nothing is charged.
    assert_eq!(hooks.wakes(), 1);
    assert!(gw.upstream_completions().is_empty());
    gw.wait_occupancy(key_id, 0, 0).await;
    assert_nothing_charged(&gw, &key).await;
}

#[tokio::test]
async fn a_node_that_overruns_the_window_after_the_boot_puts_upstream_deadline_in_the_body() {
    // 500 ms × 26 tokens/s: 13 tokens fit, so max_tokens 5 is accepted.
    let (gw, hooks) = start_asleep(Setup {
        request_window_ms: 500,
        ..Setup::waking(OnWake::ConfirmOnly)
    })
    .await;
    let (key_id, key) = gw.create_key(LimitOverrides::default()).await;
    // The node will take the request, but never answer it.
    gw.mock.close_gate();

    let (response, request_id) =
        send_committed(gw.complete_as(&key, &json_body()), "application/json").await;
    gw.mock.set_failure(FailureMode::None);
    let body = read_all(response).await;
    let (leading, json) = parse_json(&body);
    assert!(leading >= 1, "keep-alives while waiting");
    assert_error_envelope(&json, "upstream_deadline", &request_id);
    assert_eq!(hooks.wakes(), 1);
    bounded("the upstream request is aborted", gw.mock.wait_cancelled(1)).await;
    gw.wait_occupancy(key_id, 0, 0).await;
    assert_nothing_charged(&gw, &key).await;
}

#[tokio::test]
async fn a_stream_whose_node_fails_after_the_boot_gets_the_error_as_an_sse_event() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::ConfirmOnly)).await;
    gw.mock.close_gate();

    let (response, request_id) =
        send_committed(gw.complete(&stream_body()), "text/event-stream").await;
    // The node comes up and takes the request; then it fails.
    gw.mock.set_failure(FailureMode::None);
    bounded("the request reaches the node", gw.mock.wait_in_flight(1)).await;
    gw.mock.set_failure(FailureMode::Status500);
    gw.mock.open_gate();

    let body = read_all(response).await;
    let (_, events) = parse_sse(&body);
    assert_eq!(events.len(), 2, "{events:?}");
    let error: Value = serde_json::from_str(&events[0]).unwrap();
    assert_error_envelope(&error, "upstream_error", &request_id);
    assert_eq!(events[1], "[DONE]");
    assert_eq!(hooks.wakes(), 1);
}

// ---------------------------------------------------------------------------------
// Refusals come before anything is committed.

#[tokio::test]
async fn a_wake_hook_that_fails_is_a_plain_503() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::Fail)).await;

    for (n, body) in [json_body(), stream_body()].iter().enumerate() {
        let response = bounded("the 503", gw.complete(body).send()).await.unwrap();
        let headers = response.headers().clone();
        expect_error(response, 503, "upstream_unavailable").await;
        assert!(headers.contains_key("retry-after"), "{headers:?}");
        assert_eq!(headers["x-acs-upstream-error-kind"], "upstream_unavailable");
        // A failed wake starts no boot: the next request asks again.
        assert_eq!(hooks.wakes(), n + 1);
    }
    assert!(gw.upstream_completions().is_empty());
    assert_nothing_charged(&gw, &gw.key).await;
}

#[tokio::test]
async fn requests_refused_by_planning_or_admission_do_not_wake_the_model() {
    // A wake hook that fails: a request that woke the model would get its 503 instead
    // of the refusal it deserves, and every such request calls the hook again.
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::Fail)).await;
    let (_, key) = gw
        .create_key(LimitOverrides {
            monthly_budget: Some(1),
            ..LimitOverrides::default()
        })
        .await;

    let response = bounded("the 429", gw.complete_as(&key, &json_body()).send())
        .await
        .unwrap();
    expect_error(response, 429, "budget_exceeded").await;
    // 600 s × 26 tokens/s: 15,600 tokens fit.
    let too_long = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 20_000}).to_string();
    let response = bounded("the 400", gw.complete(&too_long).send())
        .await
        .unwrap();
    expect_error(response, 400, "deadline_infeasible").await;
    assert_eq!(
        hooks.wakes(),
        0,
        "a refused request must not wake the model"
    );
}

// ---------------------------------------------------------------------------------
// Concurrent requests share one boot.

#[tokio::test]
async fn concurrent_requests_share_one_boot() {
    let (gw, hooks) = start_asleep(Setup::waking(OnWake::ConfirmOnly)).await;

    // All four are committed while the node is still down: each went through the wake.
    let bodies = [json_body(), json_body(), json_body(), stream_body()];
    let responses = bounded(
        "four 200s",
        futures_util::future::join_all(bodies.iter().map(|b| gw.complete(b).send())),
    )
    .await;
    let mut responses: Vec<reqwest::Response> = responses.into_iter().map(Result::unwrap).collect();
    for response in &responses {
        assert_eq!(response.status(), 200);
    }
    assert_eq!(hooks.wakes(), 1);

    gw.mock.set_failure(FailureMode::None);
    let stream = responses.pop().unwrap();
    for response in responses {
        let body = read_all(response).await;
        assert_completion(&parse_json(&body).1);
    }
    let body = read_all(stream).await;
    assert_completion_events(&parse_sse(&body).1);
    assert_eq!(hooks.wakes(), 1);
    assert_eq!(gw.upstream_completions().len(), 4);
}

// ---------------------------------------------------------------------------------
// Keep-warm: the sleep hook.

#[tokio::test]
async fn an_idle_model_is_put_to_sleep_and_the_next_request_wakes_it() {
    let idle = Duration::from_millis(500);
    let (gw, hooks) = start(Setup {
        keep_warm: Some((idle.as_millis() as u64, 60_000)),
        ..Setup::default()
    })
    .await;

    // Batch traffic keeps the model awake only for the idle period.
    let (asked, response) = answered_as(&gw, "batch").await;
    assert_completion(&response.json().await.unwrap());
    let slept = hooks.wait_sleep(1).await;
    assert!(
        slept.duration_since(asked) >= idle,
        "slept {:?} after the request",
        slept.duration_since(asked)
    );
    assert_eq!(hooks.wakes(), 0, "it was awake for the first request");
    wait_node_up(&gw, 0).await;

    // The next request wakes it.
    let (response, _) = send_committed(gw.complete(&json_body()), "application/json").await;
    let body = read_all(response).await;
    assert_completion(&parse_json(&body).1);
    assert_eq!(hooks.wakes(), 1);
    assert_eq!(hooks.sleeps().len(), 1);
    assert_eq!(gw.upstream_completions().len(), 2);
}

#[tokio::test]
async fn interactive_traffic_keeps_the_model_warm_for_keep_warm_ms() {
    let idle = Duration::from_millis(300);
    let keep_warm = Duration::from_millis(1_500);
    let (gw, hooks) = start(Setup {
        keep_warm: Some((idle.as_millis() as u64, keep_warm.as_millis() as u64)),
        ..Setup::default()
    })
    .await;

    let (asked, response) = answered_as(&gw, "interactive").await;
    response.bytes().await.unwrap();
    // A bounded negative check: from the end of the idle period, five more probe rounds
    // pass without a sleep while the interactive request is recent.
    let observed_until =
        tokio::time::Instant::from_std(asked + idle + Duration::from_millis(5 * PROBE_INTERVAL_MS));
    assert!(
        tokio::time::timeout_at(observed_until, hooks.wait_sleep(1))
            .await
            .is_err(),
        "put to sleep while an interactive request was recent"
    );
    // Then it does sleep, once keep_warm_ms has passed.
    let slept = hooks.wait_sleep(1).await;
    assert!(
        slept.duration_since(asked) >= keep_warm,
        "slept {:?} after the interactive request",
        slept.duration_since(asked)
    );
    assert_eq!(hooks.wakes(), 0, "it was awake all along");
}

#[tokio::test]
async fn a_model_is_not_put_back_to_sleep_while_a_request_waits_for_its_boot() {
    // Idle periods shorter than the boot.
    let (gw, hooks) = start(Setup {
        keep_warm: Some((200, 200)),
        ..Setup::waking(OnWake::ConfirmOnly)
    })
    .await;
    hooks.wait_sleep(1).await;
    wait_node_up(&gw, 0).await;

    let (mut response, _) = send_committed(gw.complete(&json_body()), "application/json").await;
    // 12 keep-alive intervals (600 ms): the idle periods have passed several probe
    // rounds ago, with the request still waiting for the boot.
    let mut body = Vec::new();
    read_until(&mut response, &mut body, |b| spaces(b) >= 12).await;
    assert_eq!(hooks.sleeps().len(), 1, "put to sleep during the boot");

    gw.mock.set_failure(FailureMode::None);
    read_to_end(&mut response, &mut body).await;
    assert_completion(&parse_json(&body).1);
    assert_eq!(hooks.wakes(), 1);
}
