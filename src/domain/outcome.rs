//! What an attempt meant and why an execution stopped: the words the policy decides with, the
//! store records and the metrics count, each spelt once.

use serde::{Deserialize, Serialize};

/// What an attempt means for the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// 2xx: executed, and it worked.
    Success,
    /// Any other status not listed as retryable: executed, final, stored and replayed.
    Final,
    /// Connect failure or a `not_processed` status: the upstream did not execute it.
    NotExecuted,
    /// Timeout, broken connection or an `ambiguous` status: it may have executed.
    Ambiguous,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Success => "success",
            Class::Final => "final",
            Class::NotExecuted => "not_executed",
            Class::Ambiguous => "ambiguous",
        }
    }
}

/// Why a record's execution stopped. Recorded with the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    Success,
    FinalResponse,
    /// The attempt may have executed and the route is not replay-safe: the outcome is unknown.
    UnsafeReplay,
    AttemptCap,
    Deadline,
    /// The route's retry budget was spent.
    RetryBudget,
    /// The retry quota of the record's tenant was spent (docs/concepts.md, retry budgets).
    TenantBudget,
    /// The retry budget of the named upstream the route calls was spent.
    UpstreamBudget,
    RetryAfterBeyondDeadline,
    CircuitOpen,
    Cancelled,
    /// The route forwards the client's own credential, which only the process that received the
    /// request holds; this one does not (a take-over, a restart), so nothing is sent.
    CredentialUnavailable,
    /// Its lease expired more often than `worker.max_takeovers`: a record whose worker keeps
    /// dying on it is stopped rather than continued again.
    TakeoverCap,
    /// An operator's `retries_off` switch was on when a retry would have started.
    RetriesOff,
    /// A streamed answer's upstream cut it after its first byte reached the client.
    StreamCut,
    /// A streamed answer's upstream sent nothing for `stream_idle_timeout` after its first byte.
    StreamIdleTimeout,
}

impl StopReason {
    pub const ALL: [StopReason; 16] = [
        StopReason::Success,
        StopReason::FinalResponse,
        StopReason::UnsafeReplay,
        StopReason::AttemptCap,
        StopReason::Deadline,
        StopReason::RetryBudget,
        StopReason::TenantBudget,
        StopReason::UpstreamBudget,
        StopReason::RetryAfterBeyondDeadline,
        StopReason::CircuitOpen,
        StopReason::Cancelled,
        StopReason::CredentialUnavailable,
        StopReason::TakeoverCap,
        StopReason::RetriesOff,
        StopReason::StreamCut,
        StopReason::StreamIdleTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Success => "success",
            StopReason::FinalResponse => "final_response",
            StopReason::UnsafeReplay => "unsafe_replay",
            StopReason::AttemptCap => "attempt_cap",
            StopReason::Deadline => "deadline",
            StopReason::RetryBudget => "retry_budget",
            StopReason::TenantBudget => "tenant_budget",
            StopReason::UpstreamBudget => "upstream_budget",
            StopReason::RetryAfterBeyondDeadline => "retry_after_beyond_deadline",
            StopReason::CircuitOpen => "circuit_open",
            StopReason::Cancelled => "cancelled",
            StopReason::CredentialUnavailable => "credential_unavailable",
            StopReason::TakeoverCap => "takeover_cap",
            StopReason::RetriesOff => "retries_off",
            StopReason::StreamCut => "stream_cut",
            StopReason::StreamIdleTimeout => "stream_idle_timeout",
        }
    }

    pub fn parse(text: &str) -> Option<StopReason> {
        StopReason::ALL.into_iter().find(|r| r.as_str() == text)
    }

    /// The budget whose lack stopped it, when one did.
    pub fn budget(self) -> Option<BudgetScope> {
        BudgetScope::ALL.into_iter().find(|scope| scope.stop_reason() == self)
    }
}

/// Whose retry budget a retry is charged to: every retry is charged to its route's, its tenant's
/// and its named upstream's at once, and must fit all three (docs/concepts.md, retry budgets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BudgetScope {
    Route,
    Tenant,
    Upstream,
}

impl BudgetScope {
    pub const ALL: [BudgetScope; 3] = [BudgetScope::Route, BudgetScope::Tenant, BudgetScope::Upstream];

    /// The metric label and the name `/admin/stats` groups budgets by.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetScope::Route => "route",
            BudgetScope::Tenant => "tenant",
            BudgetScope::Upstream => "upstream",
        }
    }

    /// Why an execution stops when this budget has no retry left for it.
    pub fn stop_reason(self) -> StopReason {
        match self {
            BudgetScope::Route => StopReason::RetryBudget,
            BudgetScope::Tenant => StopReason::TenantBudget,
            BudgetScope::Upstream => StopReason::UpstreamBudget,
        }
    }
}

/// How an attempt ended, as stored and shown: its [`Class`], or `lost` (its worker died
/// mid-attempt). Serialized as the class's name, as before the type existed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    Success,
    Final,
    NotExecuted,
    Ambiguous,
    Lost,
}

impl AttemptOutcome {
    pub const ALL: [AttemptOutcome; 5] = [
        AttemptOutcome::Success,
        AttemptOutcome::Final,
        AttemptOutcome::NotExecuted,
        AttemptOutcome::Ambiguous,
        AttemptOutcome::Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Success => Class::Success.as_str(),
            AttemptOutcome::Final => Class::Final.as_str(),
            AttemptOutcome::NotExecuted => Class::NotExecuted.as_str(),
            AttemptOutcome::Ambiguous => Class::Ambiguous.as_str(),
            AttemptOutcome::Lost => "lost",
        }
    }

    pub fn parse(text: &str) -> Option<AttemptOutcome> {
        AttemptOutcome::ALL.into_iter().find(|o| o.as_str() == text)
    }
}

impl From<Class> for AttemptOutcome {
    fn from(class: Class) -> AttemptOutcome {
        match class {
            Class::Success => AttemptOutcome::Success,
            Class::Final => AttemptOutcome::Final,
            Class::NotExecuted => AttemptOutcome::NotExecuted,
            Class::Ambiguous => AttemptOutcome::Ambiguous,
        }
    }
}

/// How an attempt ended when no status arrived. Stored with the attempt by its name; `idem
/// simulate` scripts and reports spell it as a script word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptError {
    /// The connection could not be made: nothing was sent.
    ConnectFailed,
    /// Not sent: the attempt could not start within `worker.send_window` of the write that
    /// marked it, so it was given up before its first byte (docs/guarantees.md).
    NotSent,
    /// No complete response within the attempt's limit, after the request may have been written.
    TimedOut,
    /// An I/O error after the request may have been written, or a body cut after the status.
    Broken,
    /// Its worker stopped (died, or lost its lease) mid-attempt: a take-over recorded it.
    WorkerLost,
    /// A streamed answer's upstream cut it after its first byte reached the client.
    StreamCut,
    /// A streamed answer's upstream fell silent for `stream_idle_timeout` after its first byte.
    StreamIdleTimeout,
    /// The deadline ended while a streamed answer was still arriving.
    Deadline,
}

impl AttemptError {
    pub const ALL: [AttemptError; 8] = [
        AttemptError::ConnectFailed,
        AttemptError::NotSent,
        AttemptError::TimedOut,
        AttemptError::Broken,
        AttemptError::WorkerLost,
        AttemptError::StreamCut,
        AttemptError::StreamIdleTimeout,
        AttemptError::Deadline,
    ];

    /// The name stored with the attempt and shown in its record.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptError::ConnectFailed => "connect_failed",
            AttemptError::NotSent => "not_sent",
            AttemptError::TimedOut => "timed_out",
            AttemptError::Broken => "broken",
            AttemptError::WorkerLost => "worker_lost",
            AttemptError::StreamCut => "stream_cut",
            AttemptError::StreamIdleTimeout => "stream_idle_timeout",
            AttemptError::Deadline => "deadline",
        }
    }

    /// The word an `idem simulate` script writes for it, and its report shows: a script knows
    /// a failed connect, a timeout and a broken exchange. An attempt not sent reads as a failed
    /// connect (nothing left, nothing executed); anything else as broken.
    pub fn script_word(self) -> &'static str {
        match self {
            AttemptError::ConnectFailed | AttemptError::NotSent => "connect-failed",
            AttemptError::TimedOut => "timeout",
            _ => "broken",
        }
    }

    pub fn parse(text: &str) -> Option<AttemptError> {
        AttemptError::ALL.into_iter().find(|e| e.as_str() == text)
    }
}

impl Serialize for AttemptError {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for AttemptError {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<AttemptError, D::Error> {
        let text = String::deserialize(deserializer)?;
        AttemptError::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("no attempt error is named `{text}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stop_reason_outcome_and_error_is_read_back_by_its_name() {
        for stop in StopReason::ALL {
            assert_eq!(StopReason::parse(stop.as_str()), Some(stop));
        }
        for outcome in AttemptOutcome::ALL {
            assert_eq!(AttemptOutcome::parse(outcome.as_str()), Some(outcome));
        }
        for error in AttemptError::ALL {
            assert_eq!(AttemptError::parse(error.as_str()), Some(error));
            let json = serde_json::to_string(&error).unwrap();
            assert_eq!(serde_json::from_str::<AttemptError>(&json).unwrap(), error);
        }
        // The script words of `idem simulate`: three, each spelt once.
        let words: Vec<&str> = AttemptError::ALL.iter().map(|e| e.script_word()).collect();
        assert!(["connect-failed", "timeout", "broken"].iter().all(|w| words.contains(w)));
        assert_eq!(StopReason::parse("sucess"), None);
        for scope in BudgetScope::ALL {
            assert_eq!(scope.stop_reason().budget(), Some(scope));
        }
        assert_eq!(StopReason::Deadline.budget(), None);
    }
}
