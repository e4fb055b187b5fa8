//! Idem, an idempotency-aware request broker.
//!
//! A request's path through the crate:
//!
//! - [`domain`] — the ground floor: the words every layer shares (record id, tenant, route name,
//!   claim token, idempotency key and fingerprint, request path, state and phase, stop reason,
//!   attempt outcome and error, history action, answer kind, policy version, timestamp, an
//!   operator's switch, the header names the broker owns), each one type with one spelling.
//! - [`config`] — the TOML file, validated into routes and policies, each policy named by its
//!   `policy_version` (a digest of its values, see [`policy`]).
//! - [`runtime`] — each configured route's state while it serves: its places and retry budget,
//!   its upstream's breaker, the pace of its attempts and its replays and 409s counted; beside
//!   them the retry quotas of tenants and the budgets of named upstreams. Held with the
//!   configuration in one snapshot, served replaceable ([`runtime::Live`]) and swapped whole on
//!   reload: a request resolves its route there once ([`runtime::ServedRoute`]) and carries it
//!   to its end, as do an execution and a background pass. It counts in the broker's [`domain::clock`].
//! - `edge` — what stands between the network and the handlers: each listener's accept loop
//!   with its connection budget, header and body timeouts, and the bound on request bytes held
//!   in memory, so that slow or idle clients cannot starve the others.
//! - [`ingress`] — HTTP in: the [`domain::path`] checked, route match, tenant (its
//!   `credentials`), [`domain::key`] (sent, or `derived`) and [`domain::fingerprint`], and the
//!   answers of docs/concepts.md (fresh execution, replay, 409, 422, 502, 202, as the client's
//!   [`ingress::prefer`]ences ask), written by [`problem`] when the broker answers itself. Done
//!   answers are replayed from memory. It hands new requests (and a client's cancel) to the
//!   [`worker`], and reads records through its `reader`, which applies how long an answer lives.
//! - [`mcp`] — a route of `kind = "mcp"` (docs/mcp.md): JSON-RPC over MCP's Streamable HTTP read
//!   just far enough to pass every message through but `tools/call`, which the ingress records
//!   like any keyed request, tool by tool as their annotations (or the operator) say; its
//!   answers reshaped into JSON-RPC (replay, in flight, key reused, unknown).
//! - [`store`] — the durable [`record`]s, named by their [`domain::Tenant`] and
//!   [`domain::IdempotencyKey`], every time in them a [`domain::Timestamp`]: one trait, a SQLite
//!   implementation (group commit through a single writer thread) and a PostgreSQL one
//!   (`SKIP LOCKED`, `LISTEN/NOTIFY`). Each write is one named command carrying those types,
//!   the same value for both backends; the phase it leaves a record in is what the record's
//!   pure state machine ([`record::transition`]) decides, which each backend persists guarded by
//!   the phase it was decided from. A record is committed before anything goes upstream; its
//!   deadline is the route's, or shorter when the client asks in the route's `deadline_header`.
//! - [`worker`] — admits a new request in one call from the ingress ([`worker::Worker::admit`]:
//!   shed by the route's limits, or recorded and started, claimed in the same commit when a
//!   worker is free); claims a record under a lease, sends attempts through [`upstream`], stores each
//!   attempt before and after it is sent; between attempts it asks [`policy`], which is pure:
//!   classification, backoff, jitter, `Retry-After`, deadlines, the retry budget and the breaker.
//!   An execution keeps the route and policy it was claimed with, whatever a reload does, and
//!   stores every attempt with its policy's version. An answer that arrives in parts is passed
//!   through a `stream` tap to its client (and to duplicates that attach) as it arrives, and
//!   read to its end and stored whatever the client does (docs/concepts.md).
//! - `runtime::switches` — an operator's emergency switches ([`domain::switch`], docs/operations.md:
//!   `retries_off`, `isolate` or `canary_off` over one route or all, with a reason, an expiry
//!   and an audit) as this node obeys them: kept by the [`store`], held in memory, refreshed
//!   from the store twice a second, so that the worker and the ingress obey them without a
//!   store round trip.
//! - [`upkeep`] — the background loops on every node: take-over of expired leases, probes of
//!   `unknown` records, the retention sweep; the reload on `SIGHUP` and `POST
//!   /admin/config/reload` (the file validated like `idem check`, then applied whole or refused
//!   whole, naming the key); the canaries judged from the store's figures, each ended by a
//!   `canary_off` switch when it does harm (a stable slice of a route's requests runs the
//!   candidate policy, chosen per request by `Route::policy_for`); and the replays and 409s
//!   counted in memory, added to the store every second. The store's own health checks, which
//!   refuse new requests while the store cannot record them, live in [`store`].
//! - [`admin`] — the operator listener: the admin API (one record's actions, and the same
//!   actions over a filter's matches, planned by a dry run first), its CLI, the console, health;
//!   the `/admin/stats` series, computed from the store; `observe::metrics` for `/metrics`.
//! - [`server`] — wires it together and runs both listeners until a graceful shutdown, telling
//!   systemd where it stands (`server::notify`); [`server::demo`] runs it in front of a
//!   built-in flaky upstream.
//! - [`simulate`] — `idem simulate`: a route's policy, through the worker's own sequence of
//!   decisions, against a scripted upstream on a logical clock; with `--history`, a route's
//!   recorded requests (read from the store read-only) replayed through its current policy and
//!   a candidate, sharing each policy's retry budget in time order.
//! - [`domain::clock`] — the time, passed in: every part above reads what time it is from one
//!   [`domain::clock::Clock`] (the system's, or a test's [`domain::clock::ManualClock`]); waits use
//!   tokio's timer.
//! - [`observe`] — what the broker tells of itself: [`observe::logs`], where log lines go (a
//!   buffer that a thread of its own writes to stderr in batches, so logging a line wakes
//!   nobody); `observe::metrics`, the figures of `/metrics`; [`observe::telemetry`], the spans
//!   exported over OTLP/HTTP, and the W3C trace context carried from the client through each
//!   attempt to the upstream.

// Everything below the face (the modules declared `pub`, and `test_support`) is `pub(crate)`.
// The lint is judged where the face is widest, with `test-support`, which every `cargo test`
// builds: an item that only the tests reach is `pub` for them, not a leak.
#![cfg_attr(feature = "test-support", warn(unreachable_pub))]

pub mod admin;
pub mod config;
pub mod domain;
pub(crate) mod edge;
pub(crate) mod ingress;
pub(crate) mod mcp;
pub mod observe;
pub(crate) mod policy;
pub(crate) mod problem;
pub mod record;
pub(crate) mod runtime;
pub mod server;
pub mod simulate;
pub mod store;
pub(crate) mod stream;
pub(crate) mod upkeep;
pub(crate) mod upstream;
pub(crate) mod worker;

/// What the tests that drive a node below HTTP reach (a node assembled from its parts on a
/// manual clock, the parsers' property tests, the hot path's benchmark), and nothing else does:
/// built only with the `test-support` feature, which the crate's own tests and benches turn on.
#[cfg(feature = "test-support")]
pub mod test_support {
    pub mod worker {
        pub use crate::worker::{Admitted, Awaited, Outcome, Parts, Request, Settled, Submission, Told, Worker};
    }
    pub mod upkeep {
        pub use crate::upkeep::{after_lease_expiry, probe_once, Sweeper};
    }
    pub use crate::ingress::prefer::{Prefer, MAX_WAIT_SECS};
    pub use crate::ingress::{Replay, EXPIRES_HEADER, REPLAYED_HEADER};
    pub use crate::mcp::{message::read as read_mcp_message, Incoming};
    pub use crate::observe::metrics::handle as metrics_handle;
    pub use crate::policy::{parse_retry_after, MAX_RETRY_AFTER};
    pub use crate::problem::{SHOULD_RETRY_HEADER, STATUS_HEADER};
    pub use crate::runtime::switches::Switches;
    pub use crate::runtime::Live;
    pub use crate::upstream::{to_header_map, Upstream};
}
