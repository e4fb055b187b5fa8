//! The ground floor: the words every layer shares, each one type with one spelling. A record's
//! id, tenant, route and claim, its idempotency key and fingerprint, its state and phase, why its execution stopped, what an attempt
//! meant, what its history says, which answer a request got, a policy's version, where a request
//! came from and the time.
//! The metric label, the problem, the history entry and the SQL bind all come from these values.
//! It depends on nothing else in the crate.

mod answer;
pub mod clock;
pub mod fingerprint;
pub(crate) mod headers;
mod history;
mod ids;
pub mod key;
mod origin;
mod outcome;
pub(crate) mod path;
mod state;
pub mod switch;
mod time;

pub use answer::AnswerKind;
pub use fingerprint::Fingerprint;
pub use history::{Actor, HistoryAction};
pub use ids::{ClaimToken, Holder, Owner, PolicyVersion, RecordId, RouteName, Tenant};
pub use key::IdempotencyKey;
pub use origin::Origin;
pub use outcome::{AttemptError, AttemptOutcome, BudgetScope, Class, StopReason};
pub use state::{Phase, State};
pub use time::{Arrival, Timestamp};

/// The JSON-RPC method of an MCP tool call (docs/mcp.md): the one MCP message a route records,
/// and what names a record's tool.
pub const MCP_TOOLS_CALL: &str = "tools/call";
