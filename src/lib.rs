//! Idem, an idempotency-aware request broker.
//!
//! A request's path through the crate:
//!
//! - [`config`] — the TOML file, validated into routes and policies.
//! - [`ingress`] — HTTP in: route match, tenant, [`key`] and [`fingerprint`], and the answers of
//!   SPEC §3 (fresh execution, replay, 409, 422, 502, 202).
//! - [`store`] — the durable [`record`]s: a trait with a SQLite implementation (group commit
//!   through a single writer). A record is committed before anything goes upstream.
//! - [`worker`] — claims a record, sends attempts through [`upstream`], stores each attempt and
//!   the outcome; between attempts it asks [`policy`], which is pure: classification, backoff,
//!   jitter, `Retry-After`, deadlines.
//! - [`reconcile`] — background upkeep: the retention sweep.
//! - [`admin`] — the operator listener: health and readiness.
//! - [`server`] — wires it together and runs both listeners until shutdown; [`demo`] runs it in
//!   front of a built-in flaky upstream.

pub mod admin;
pub mod config;
pub mod demo;
pub mod fingerprint;
pub mod ingress;
pub mod key;
pub mod metrics;
pub mod policy;
pub mod problem;
pub mod reconcile;
pub mod record;
pub mod server;
pub mod store;
pub mod upstream;
pub mod worker;
