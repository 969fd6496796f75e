//! OpenTelemetry traces (`[traces]`, off unless an OTLP endpoint is configured): the
//! exporter behind the `tracing` spans of the request path, and the W3C trace context
//! read from a client and handed on to vLLM.
//!
//! The request path only opens `tracing` spans: the root `request` span (router), and
//! `auth`, `parse`, `plan`, `admit`, `route`, `upstream` and `relay` beneath it, all at
//! debug level. Logging filters those out, so with traces off they are never built; with
//! traces on, [`layer`] turns every span into an OpenTelemetry span and the batch
//! exporter ships them from a thread of its own, off the request path.

use http::HeaderMap;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::LookupSpan;

use crate::config::TraceSettings;

/// The OTLP/HTTP path of the traces signal, appended to the configured endpoint.
const TRACES_PATH: &str = "/v1/traces";

/// The exporting side of traces: a tracer provider with a batch exporter. Shut it down
/// ([`Exporter::shutdown`]) once the server is done, so the last spans are sent.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// The exporter `settings` ask for; `None` when traces are off.
    pub fn start(settings: &TraceSettings) -> anyhow::Result<Option<Self>> {
        let Some(endpoint) = settings.otlp_endpoint.as_deref() else {
            return Ok(None);
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/')))
            .build()?;
        // Parent-based: a client's sampling decision (its `traceparent` flags) is kept,
        // so a trace is whole or absent; new traces are kept at `sample_ratio`. Only an
        // authenticated request continues a client's trace (`every_request`).
        let sampler =
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(settings.sample_ratio)));
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(sampler)
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .build(),
            )
            .build();
        Ok(Some(Self { provider }))
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans for this exporter.
    pub fn layer<S>(
        &self,
    ) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
    where
        S: tracing::Subscriber + for<'span> LookupSpan<'span>,
    {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("fleetgate"))
    }

    /// Exports the spans still queued and stops the exporter (blocks until it has, or
    /// until the exporter's timeout).
    pub fn shutdown(self) {
        if let Err(err) = self.provider.shutdown() {
            tracing::warn!(error = %err, "the trace exporter did not shut down cleanly");
        }
    }
}

/// Makes `span` continue the trace of a client's `traceparent` (and `tracestate`), if
/// the request carries a valid one; otherwise the span starts a trace of its own.
pub fn continue_trace(span: &tracing::Span, headers: &HeaderMap) {
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // Fails only when the span is disabled (no traces layer): nothing to continue then.
    let _ = span.set_parent(parent);
}

/// `traceparent` (and `tracestate`) naming `span` as the parent, for a request sent on
/// to a node; empty when `span` is not traced.
pub fn trace_headers(span: &tracing::Span) -> HeaderMap {
    let mut headers = HeaderMap::new();
    TraceContextPropagator::new()
        .inject_context(&span.context(), &mut HeaderInjector(&mut headers));
    headers
}
