//! Traces: `fleetgate serve` (the real binary, `[traces]` pointed at an OTLP/HTTP receiver
//! in the test) in front of an in-process mock-vllm. The exporter is part of the global
//! subscriber, so each test runs a gateway process of its own; stopping it (SIGTERM) must
//! export its spans, which is how a test knows they have all arrived.

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
        reason = "the node runs in this process, not on a runtime of its own"
    )]
    pub mod processes;
}

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post;
use bytes::Bytes;
use common::cli::create_key;
use common::processes::{Proc, serve, signal};
use mock_vllm::{MockConfig, MockVllm};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// A prompt no span may carry.
const PROMPT: &str = "The secret ingredient of the soup is saffron";
/// The stages beneath the root `request` span of a completion.
const STAGES: [&str; 7] = [
    "auth", "parse", "plan", "admit", "route", "upstream", "relay",
];
/// A stopped gateway exits within this.
const EXIT: Duration = Duration::from_secs(30);

/// What an OTLP/HTTP receiver was sent: the service names and the spans.
#[derive(Default)]
struct Received {
    services: Vec<String>,
    spans: Vec<Span>,
}

/// `POST /v1/traces` (protobuf) on port 0; what arrives is kept until the test reads it.
async fn receiver() -> (String, Arc<Mutex<Received>>) {
    async fn collect(State(received): State<Arc<Mutex<Received>>>, body: Bytes) {
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        let mut received = received.lock().unwrap();
        for resource_spans in request.resource_spans {
            let resource = resource_spans.resource.unwrap_or_default();
            received
                .services
                .extend(string_attribute(&resource.attributes, "service.name"));
            for scope_spans in resource_spans.scope_spans {
                received.spans.extend(scope_spans.spans);
            }
        }
    }
    let received = Arc::new(Mutex::new(Received::default()));
    let app = axum::Router::new()
        .route("/v1/traces", post(collect))
        .with_state(Arc::clone(&received));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

/// Every string an attribute value holds, nested ones included.
fn strings(value: &AnyValue, out: &mut Vec<String>) {
    match &value.value {
        Some(Value::StringValue(s)) => out.push(s.clone()),
        Some(Value::ArrayValue(array)) => array.values.iter().for_each(|v| strings(v, out)),
        Some(Value::KvlistValue(list)) => list
            .values
            .iter()
            .filter_map(|kv| kv.value.as_ref())
            .for_each(|v| strings(v, out)),
        _ => {}
    }
}

fn config(dir: &Path, upstream: &str, traces: &str) -> std::path::PathBuf {
    let path = dir.join("fleetgate.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase_url = \"sqlite://{}/fg.db\"\n\n[traces]\n{traces}\n\n[[models]]\nid = \"llama-8b\"\n\n[[models.upstreams]]\nurl = \"{upstream}\"\ngpu = \"gpu-a\"\n",
            dir.display()
        ),
    )
    .unwrap();
    path
}

/// Stops the gateway as an operator would (SIGTERM) and waits until it has exited.
async fn stop(server: Proc) {
    signal(&server.0, "TERM");
    let exited = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.0.wait().unwrap()
    });
    let status = tokio::time::timeout(EXIT, exited).await.unwrap().unwrap();
    assert!(status.success(), "fleetgate exited with {status}");
}

/// One traced completion: its request id and the spans exported for it.
struct Traced {
    request_id: String,
    services: Vec<String>,
    spans: Vec<Span>,
    /// The `traceparent` the node received, if any.
    traceparent: Option<String>,
    secret: String,
    /// The node's address, which spans name by its label instead.
    node: String,
}

/// Runs a gateway with traces on, sends one completion (with `traceparent`, if given),
/// stops the gateway and collects what was exported.
async fn traced_completion(traceparent: Option<&str>) -> Traced {
    let (collector, received) = receiver().await;
    let mock = MockVllm::start(MockConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(
        dir.path(),
        &mock.url(),
        &format!("otlp_endpoint = \"{collector}\""),
    );
    let secret = create_key(&config, "traces");
    let (server, url) = serve(&config, "traced");
    let mut request = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(&secret)
        .json(&serde_json::json!({"model": "llama-8b", "prompt": PROMPT, "max_tokens": 4}));
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    response.text().await.unwrap();
    stop(server).await;
    let traceparent = mock
        .received()
        .into_iter()
        .find(|r| r.path == "/v1/completions")
        .unwrap()
        .headers
        .get("traceparent")
        .map(|v| v.to_str().unwrap().to_owned());
    let Received { services, spans } = std::mem::take(&mut *received.lock().unwrap());
    Traced {
        request_id,
        services,
        spans,
        traceparent,
        secret,
        node: mock.url().trim_start_matches("http://").to_owned(),
    }
}

impl Traced {
    /// The root span of the completion (the one carrying its request id), and its stages.
    fn tree(&self) -> (&Span, Vec<&Span>) {
        let root = self
            .spans
            .iter()
            .find(|s| {
                s.name == "request"
                    && string_attribute(&s.attributes, "request_id").as_deref()
                        == Some(self.request_id.as_str())
            })
            .unwrap_or_else(|| panic!("no request span for {}", self.request_id));
        let children = self
            .spans
            .iter()
            .filter(|s| s.trace_id == root.trace_id && s.parent_span_id == root.span_id)
            .collect();
        (root, children)
    }

    /// The node's `traceparent`, split: (trace id, parent span id, flags).
    fn forwarded(&self) -> (String, String, String) {
        let traceparent = self.traceparent.as_deref().expect("a traceparent upstream");
        let parts: Vec<&str> = traceparent.split('-').collect();
        assert_eq!(parts.len(), 4, "{traceparent}");
        assert_eq!(parts[0], "00", "{traceparent}");
        (parts[1].into(), parts[2].into(), parts[3].into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_is_one_trace_handed_on_to_the_node() {
    let traced = traced_completion(None).await;
    assert!(
        traced.services.iter().all(|s| s == "fleetgate") && !traced.services.is_empty(),
        "service.name: {:?}",
        traced.services
    );
    let (root, children) = traced.tree();
    assert!(
        root.parent_span_id.is_empty(),
        "a new trace starts at the root"
    );
    assert_eq!(
        string_attribute(&root.attributes, "model").as_deref(),
        Some("llama-8b")
    );
    let status = root.attributes.iter().find(|kv| kv.key == "status");
    assert!(
        matches!(
            status.and_then(|kv| kv.value.as_ref()?.value.as_ref()),
            Some(Value::IntValue(200))
        ),
        "status in {:?}",
        root.attributes
    );
    let mut names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    let mut expected = STAGES.to_vec();
    expected.sort_unstable();
    assert_eq!(names, expected, "the stages beneath the root");
    let upstream = children.iter().find(|s| s.name == "upstream").unwrap();
    assert_eq!(
        string_attribute(&upstream.attributes, "gpu").as_deref(),
        Some("gpu-a")
    );

    let (trace_id, parent, flags) = traced.forwarded();
    assert_eq!(
        trace_id,
        hex(&root.trace_id),
        "vLLM joins the gateway's trace"
    );
    assert_eq!(parent, hex(&upstream.span_id), "under the upstream span");
    assert_eq!(flags, "01", "sampled");

    let mut exported = Vec::new();
    for span in &traced.spans {
        let events = span.events.iter().flat_map(|e| &e.attributes);
        for kv in span.attributes.iter().chain(events) {
            if let Some(value) = &kv.value {
                strings(value, &mut exported);
            }
        }
    }
    assert!(!exported.is_empty());
    for value in &exported {
        assert!(!value.contains(PROMPT), "the prompt in a span: {value}");
        assert!(
            !value.contains(&traced.secret),
            "the key in a span: {value}"
        );
        assert!(
            !value.contains(&traced.node),
            "the node's address in a span: {value}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_traceparent_is_continued() {
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traced = traced_completion(Some(&format!("00-{client_trace}-{client_span}-01"))).await;
    let (root, children) = traced.tree();
    assert_eq!(hex(&root.trace_id), client_trace);
    assert_eq!(hex(&root.parent_span_id), client_span);
    assert_eq!(children.len(), STAGES.len());
    let (trace_id, parent, _) = traced.forwarded();
    assert_eq!(trace_id, client_trace);
    assert_ne!(
        parent, client_span,
        "the gateway's own span is the node's parent"
    );
}

/// A client's sampled flag is honoured only once its request has shown a key: with
/// `sample_ratio = 0`, an unauthenticated request's `traceparent` exports nothing, while
/// an authenticated one's still does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_authenticated_traceparent_forces_export() {
    let (collector, received) = receiver().await;
    let mock = MockVllm::start(MockConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config(
        dir.path(),
        &mock.url(),
        &format!("otlp_endpoint = \"{collector}\"\nsample_ratio = 0.0"),
    );
    let secret = create_key(&config, "traces");
    let (server, url) = serve(&config, "traced");
    let client = reqwest::Client::new();
    let authenticated = "4bf92f3577b34da6a3ce929d0e0e4736";
    let anonymous = "5ce92f3577b34da6a3ce929d0e0e4737";
    let models = |trace: &str| {
        client
            .get(format!("{url}/v1/models"))
            .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
    };
    let served = models(authenticated).bearer_auth(&secret).send().await;
    assert_eq!(served.unwrap().status(), 200);
    for key in [None, Some("sk-not-a-key")] {
        let mut request = models(anonymous);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        assert_eq!(request.send().await.unwrap().status(), 401);
    }
    stop(server).await;
    let received = received.lock().unwrap();
    let exported = |trace: &str| {
        received
            .spans
            .iter()
            .filter(|s| hex(&s.trace_id) == trace)
            .count()
    };
    assert!(
        exported(authenticated) > 0,
        "an authenticated traceparent is followed"
    );
    assert_eq!(
        exported(anonymous),
        0,
        "an unauthenticated traceparent forced export"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
