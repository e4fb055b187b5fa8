//! `[telemetry]`: where Idem's spans go (docs/operations.md#traces).

use serde::Deserialize;

use super::{invalid, ConfigError};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    otlp_endpoint: Option<String>,
    service_name: Option<String>,
    sampling_ratio: Option<f64>,
}

/// Traces exported over OTLP/HTTP, when an endpoint is set.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base URL (`http://collector:4318`); spans go to its
    /// `/v1/traces`. `None`: spans are made for the logs only, and nothing is exported.
    pub otlp_endpoint: Option<url::Url>,
    /// `service.name` on every span.
    pub service_name: String,
    /// The share of new traces recorded (0 to 1); a request whose client's `traceparent` says
    /// sampled is recorded whatever this says, one that says not sampled is not.
    pub sampling_ratio: f64,
}

impl RawTelemetry {
    pub(super) fn validate(self) -> Result<TelemetryConfig, ConfigError> {
        let otlp_endpoint = self
            .otlp_endpoint
            .map(|text| {
                let url = url::Url::parse(&text).map_err(|e| {
                    invalid(
                        "telemetry.otlp_endpoint",
                        format!("`{text}` is not a URL like \"http://collector:4318\": {e}"),
                    )
                })?;
                if !matches!(url.scheme(), "http" | "https") {
                    return Err(invalid(
                        "telemetry.otlp_endpoint",
                        format!("`{text}` must be an http(s) URL (OTLP/HTTP)"),
                    ));
                }
                if url.password().is_some() {
                    return Err(invalid("telemetry.otlp_endpoint", "must not carry a password"));
                }
                Ok(url)
            })
            .transpose()?;
        let service_name = self.service_name.unwrap_or_else(|| "idem".into());
        if service_name.trim().is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        let sampling_ratio = self.sampling_ratio.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&sampling_ratio) {
            return Err(invalid("telemetry.sampling_ratio", format!("must be between 0 and 1, got {sampling_ratio}")));
        }
        Ok(TelemetryConfig { otlp_endpoint, service_name, sampling_ratio })
    }
}
