//! The answers the broker gives without an execution of the request's own, by kind: what
//! `idem_answers_total{kind}` counts.

/// An answer without a new execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AnswerKind {
    /// A done record's stored response.
    Replay,
    /// 409: the record is queued or in progress.
    InProgress,
    /// 422: the key came with another request.
    KeyReused,
    /// 502: the record's outcome is unknown.
    Unknown,
    /// The record was freed while the request waited.
    Freed,
    /// A duplicate that waited joined the answer streaming to the first request.
    Attached,
    /// 503: the request bodies held in memory are at their bound.
    BuffersFull,
    /// 410: a done record past its retention.
    ResultExpired,
    /// 503: the route's places are taken.
    Overloaded,
    /// 503: the route's circuit is open, or an operator isolated it.
    CircuitOpen,
}

impl AnswerKind {
    /// The metric's `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerKind::Replay => "replay",
            AnswerKind::InProgress => "in_progress",
            AnswerKind::KeyReused => "key_reused",
            AnswerKind::Unknown => "unknown",
            AnswerKind::Freed => "freed",
            AnswerKind::Attached => "attached",
            AnswerKind::BuffersFull => "buffers_full",
            AnswerKind::ResultExpired => "result_expired",
            AnswerKind::Overloaded => "overloaded",
            AnswerKind::CircuitOpen => "circuit_open",
        }
    }
}
