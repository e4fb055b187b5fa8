//! Traces (docs/operations.md#traces): Idem's spans exported over OTLP/HTTP when `[telemetry]
//! otlp_endpoint` is set, and the W3C trace context carried through it. A client's `traceparent`
//! becomes the parent of its request's span; the execution is that span's child, each attempt
//! the execution's; and each attempt sends the upstream a `traceparent` naming itself, so the
//! upstream's spans hang beneath the attempt that caused them.
//!
//! Spans are batched and sent by the exporter's own thread, off the request path; a collector
//! that is slow or down loses spans, never time on a request. The batch's HTTP request is made
//! by the broker's own client on the broker's runtime.

use std::sync::LazyLock;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::Registry;
use tracing_subscriber::Layer;

use crate::config::TelemetryConfig;

/// How long one export may take: a collector that takes longer loses that batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// `traceparent` and `tracestate`, read and written.
static PROPAGATOR: LazyLock<TraceContextPropagator> = LazyLock::new(TraceContextPropagator::new);

#[derive(Debug, thiserror::Error)]
#[error("cannot start the trace exporter: {0}")]
pub struct TelemetryError(String);

/// The exporter, running: its layer makes the spans, and [`Telemetry::shutdown`] sends the last
/// batch before the process ends.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Starts exporting to `config`'s endpoint, if it names one. The exports run on `runtime`.
    pub fn start(
        config: &TelemetryConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Option<Telemetry>, TelemetryError> {
        let Some(endpoint) = &config.otlp_endpoint else { return Ok(None) };
        // The collector's base URL, as OTLP/HTTP names it: traces go to its `/v1/traces`.
        let url = format!("{}/v1/traces", endpoint.as_str().trim_end_matches('/'));
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Collector { http, runtime })
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            // A client's decision stands; a trace that starts here is kept at the ratio.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sampling_ratio))))
            .with_resource(Resource::builder().with_service_name(config.service_name.clone()).build())
            .build();
        Ok(Some(Telemetry { provider }))
    }

    /// The layer that turns Idem's spans into exported ones.
    pub fn layer(&self) -> Box<dyn Layer<Registry> + Send + Sync> {
        tracing_opentelemetry::layer().with_tracer(self.provider.tracer("idem")).boxed()
    }

    /// Sends what is still batched and stops the exporter. Blocks: call it off the runtime's
    /// worker threads.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "the last spans could not be exported");
        }
    }
}

/// Makes `span` a child of the trace the client's `traceparent` names, if it sent one.
pub fn continue_trace(span: &Span, headers: &http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let parent = PROPAGATOR.extract(&opentelemetry_http::HeaderExtractor(headers));
    // Refused only when no exporter makes spans: then there is nothing to continue.
    let _ = span.set_parent(parent);
}

/// Puts the current span's `traceparent` (an attempt's, when an attempt sends) in `headers`,
/// replacing the client's; nothing when no span is exported.
pub fn tell_trace(headers: &mut http::HeaderMap) {
    let context = Span::current().context();
    if context.span().span_context().is_valid() {
        PROPAGATOR.inject_context(&context, &mut opentelemetry_http::HeaderInjector(headers));
    }
}

/// The trace `span` belongs to, as 32 hex digits; `None` when no span is exported.
pub fn trace_id(span: &Span) -> Option<String> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then(|| span_context.trace_id().to_string())
}

/// The trace id a `traceparent` header names (`00-<trace id>-<span id>-<flags>`), if it is one.
pub fn client_trace_id(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get("traceparent")?.to_str().ok()?;
    let mut parts = value.split('-');
    let (_version, trace) = (parts.next()?, parts.next()?);
    let valid = trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit()) && trace != "0".repeat(32);
    valid.then_some(trace)
}

/// The exporter's HTTP client: the broker's own (rustls), its requests run on the broker's
/// runtime, since the exporter's thread has none.
#[derive(Debug)]
struct Collector {
    http: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Collector {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let http = self.http.clone();
        let request = reqwest::Request::try_from(request)?;
        let sent = self.runtime.spawn(async move {
            let response = http.execute(request).await?;
            let mut answer = http::Response::builder().status(response.status());
            for (name, value) in response.headers() {
                answer = answer.header(name, value);
            }
            let body = response.bytes().await?;
            Ok::<_, opentelemetry_http::HttpError>(answer.body(body)?)
        });
        sent.await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_trace_id_is_read_from_a_well_formed_traceparent_only() {
        let with = |value: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert("traceparent", value.parse().unwrap());
            client_trace_id(&headers).map(str::to_string)
        };
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert_eq!(with(&format!("00-{id}-00f067aa0ba902b7-01")), Some(id.to_string()));
        assert_eq!(with("00-4bf92f3577b34da6-00f067aa0ba902b7-01"), None, "too short");
        assert_eq!(with(&format!("00-{}-00f067aa0ba902b7-01", "0".repeat(32))), None, "all zeros");
        assert_eq!(with(&format!("00-{}-00f067aa0ba902b7-01", "x".repeat(32))), None, "not hex");
        assert_eq!(with("garbage"), None);
        assert_eq!(client_trace_id(&http::HeaderMap::new()), None);
    }
}
