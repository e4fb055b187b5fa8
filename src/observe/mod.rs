//! What the broker tells about itself: its log lines (`logs`, a writer thread of their own, and
//! `access_line`, the access log's own formatter), its figures (`metrics`, for `/metrics`), and
//! its spans (`telemetry`, over OTLP, with the W3C trace context carried from the client to the
//! upstream).

pub mod access_line;
pub mod logs;
pub(crate) mod metrics;
pub mod telemetry;
