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
    /// Starts exporting where `config` and the standard OpenTelemetry environment say (see
    /// [`Otlp`]), if either names a collector. The exports run on `runtime`.
    pub fn start(
        config: &TelemetryConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Option<Telemetry>, TelemetryError> {
        Telemetry::start_with_env(config, runtime, |name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    /// [`Telemetry::start`], with `env` as the environment.
    pub fn start_with_env(
        config: &TelemetryConfig,
        runtime: tokio::runtime::Handle,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Telemetry>, TelemetryError> {
        let Some(otlp) = Otlp::resolve(config, &env)? else { return Ok(None) };
        let mut http = reqwest::Client::builder().no_proxy().timeout(EXPORT_TIMEOUT);
        if let Some(path) = env("OTEL_EXPORTER_OTLP_CERTIFICATE") {
            let pem = read_pem("OTEL_EXPORTER_OTLP_CERTIFICATE", &path)?;
            for cert in
                reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| named("OTEL_EXPORTER_OTLP_CERTIFICATE", e))?
            {
                http = http.add_root_certificate(cert);
            }
        }
        match (env("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"), env("OTEL_EXPORTER_OTLP_CLIENT_KEY")) {
            (Some(cert), Some(key)) => {
                let mut pem = read_pem("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &cert)?;
                pem.extend(read_pem("OTEL_EXPORTER_OTLP_CLIENT_KEY", &key)?);
                let identity =
                    reqwest::Identity::from_pem(&pem).map_err(|e| named("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", e))?;
                http = http.identity(identity);
            }
            (None, None) => {}
            _ => {
                return Err(TelemetryError(
                    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY go together".into(),
                ))
            }
        }
        let http = http.build().map_err(|e| TelemetryError(e.to_string()))?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Collector { http, runtime })
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(otlp.url)
            .with_headers(otlp.headers)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let resource = Resource::builder()
            .with_service_name(otlp.service_name)
            .with_attributes([
                opentelemetry::KeyValue::new("service.version", crate::observe::metrics::VERSION),
                opentelemetry::KeyValue::new("service.instance.id", instance_id()),
            ])
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(otlp.sampler)
            .with_resource(resource)
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

/// Where spans go and how they are chosen: `[telemetry]`, and over it the environment variables
/// of OpenTelemetry's specification (docs/operations.md#traces).
struct Otlp {
    /// The collector's traces URL: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` (else `otlp_endpoint`) with `/v1/traces`.
    url: String,
    /// `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else `OTEL_EXPORTER_OTLP_HEADERS`: `key=value,…`,
    /// values percent-encoded.
    headers: std::collections::HashMap<String, String>,
    /// `OTEL_SERVICE_NAME`, else `service_name`.
    service_name: String,
    /// `OTEL_TRACES_SAMPLER` (and `OTEL_TRACES_SAMPLER_ARG`), else a client's decision, and
    /// `sampling_ratio` of the traces that start here.
    sampler: Sampler,
}

impl Otlp {
    fn resolve(
        config: &TelemetryConfig,
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Otlp>, TelemetryError> {
        let base = |url: &str| format!("{}/v1/traces", url.trim_end_matches('/'));
        let url = match (
            env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            env("OTEL_EXPORTER_OTLP_ENDPOINT"),
            &config.otlp_endpoint,
        ) {
            (Some(traces), _, _) => traces,
            (None, Some(endpoint), _) => base(&endpoint),
            (None, None, Some(endpoint)) => base(endpoint.as_str()),
            (None, None, None) => return Ok(None),
        };
        let headers = match env("OTEL_EXPORTER_OTLP_TRACES_HEADERS").or_else(|| env("OTEL_EXPORTER_OTLP_HEADERS")) {
            Some(list) => headers(&list)?,
            None => Default::default(),
        };
        let service_name = env("OTEL_SERVICE_NAME").unwrap_or_else(|| config.service_name.clone());
        let ratio = |what: &str| -> Result<f64, TelemetryError> {
            match env("OTEL_TRACES_SAMPLER_ARG") {
                None => Ok(1.0),
                Some(arg) => arg.trim().parse::<f64>().ok().filter(|r| (0.0..=1.0).contains(r)).ok_or_else(|| {
                    TelemetryError(format!("OTEL_TRACES_SAMPLER_ARG={arg}: {what} takes a ratio from 0 to 1"))
                }),
            }
        };
        let parent = |root: Sampler| Sampler::ParentBased(Box::new(root));
        let sampler = match env("OTEL_TRACES_SAMPLER").as_deref() {
            // A client's decision stands; a trace that starts here is kept at the ratio.
            None => parent(Sampler::TraceIdRatioBased(config.sampling_ratio)),
            Some("always_on") => Sampler::AlwaysOn,
            Some("always_off") => Sampler::AlwaysOff,
            Some("traceidratio") => Sampler::TraceIdRatioBased(ratio("traceidratio")?),
            Some("parentbased_always_on") => parent(Sampler::AlwaysOn),
            Some("parentbased_always_off") => parent(Sampler::AlwaysOff),
            Some("parentbased_traceidratio") => parent(Sampler::TraceIdRatioBased(ratio("parentbased_traceidratio")?)),
            Some(other) => {
                return Err(TelemetryError(format!(
                    "OTEL_TRACES_SAMPLER={other}: give always_on, always_off, traceidratio, parentbased_always_on, \
                     parentbased_always_off or parentbased_traceidratio"
                )))
            }
        };
        Ok(Some(Otlp { url, headers, service_name, sampler }))
    }
}

/// `key=value,key2=value2`, values percent-encoded, as OpenTelemetry's specification writes
/// headers for the exporter.
fn headers(list: &str) -> Result<std::collections::HashMap<String, String>, TelemetryError> {
    list.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| TelemetryError(format!("OTEL_EXPORTER_OTLP_HEADERS: `{pair}` is not key=value")))?;
            let value = percent_encoding::percent_decode_str(value.trim()).decode_utf8_lossy().into_owned();
            Ok((key.trim().to_ascii_lowercase(), value))
        })
        .collect()
}

fn read_pem(variable: &str, path: &str) -> Result<Vec<u8>, TelemetryError> {
    std::fs::read(path).map_err(|e| TelemetryError(format!("{variable}: cannot read {path}: {e}")))
}

fn named(variable: &str, e: impl std::fmt::Display) -> TelemetryError {
    TelemetryError(format!("{variable}: {e}"))
}

/// This process's `service.instance.id`: one per process, as OpenTelemetry recommends.
pub fn instance_id() -> &'static str {
    static ID: LazyLock<String> = LazyLock::new(|| uuid::Uuid::new_v4().to_string());
    &ID
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

    fn config() -> TelemetryConfig {
        TelemetryConfig { otlp_endpoint: None, service_name: "idem".into(), sampling_ratio: 0.5 }
    }

    /// The standard environment variables are read over `[telemetry]`, and refused naming
    /// themselves when wrong.
    #[test]
    fn the_opentelemetry_environment_is_read_over_the_config() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        assert!(Otlp::resolve(&config(), &env(&[])).unwrap().is_none(), "nothing named: no export");
        let otlp = Otlp::resolve(
            &config(),
            &env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318/"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20s3cret, x-tenant=acme"),
                ("OTEL_SERVICE_NAME", "payments-gateway"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(otlp.url, "https://collector:4318/v1/traces");
        assert_eq!(otlp.headers["authorization"], "Bearer s3cret");
        assert_eq!(otlp.headers["x-tenant"], "acme");
        assert_eq!(otlp.service_name, "payments-gateway");
        let traces = env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom")]);
        assert_eq!(Otlp::resolve(&config(), &traces).unwrap().unwrap().url, "http://c:4318/custom", "as it is");
        for (pairs, said) in [
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_TRACES_SAMPLER", "sometimes")][..],
                "OTEL_TRACES_SAMPLER=sometimes",
            ),
            (
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "2"),
                ][..],
                "OTEL_TRACES_SAMPLER_ARG=2",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), ("OTEL_EXPORTER_OTLP_HEADERS", "novalue")][..],
                "OTEL_EXPORTER_OTLP_HEADERS",
            ),
        ] {
            let pairs: &'static [(&'static str, &'static str)] = Box::leak(pairs.to_vec().into_boxed_slice());
            let e = Otlp::resolve(&config(), &env(pairs)).err().expect("refused").to_string();
            assert!(e.contains(said), "{e}");
        }
    }

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
