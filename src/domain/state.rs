//! Where a record stands: its state, as clients and operators see it, and its phase, which
//! tells a queued `not_started` record from a free one.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Recorded; nothing can have reached the upstream yet. Either queued for a worker or free.
    NotStarted,
    /// A worker holds a lease on it and an attempt may be in flight.
    InProgress,
    /// Final: a response is stored and replayed until retention ends.
    Done,
    /// An attempt may have executed and the route is not replay-safe: waits for reconciliation.
    Unknown,
}

impl State {
    pub const ALL: [State; 4] = [State::NotStarted, State::InProgress, State::Done, State::Unknown];

    pub fn as_str(self) -> &'static str {
        match self {
            State::NotStarted => "not_started",
            State::InProgress => "in_progress",
            State::Done => "done",
            State::Unknown => "unknown",
        }
    }

    pub fn parse(text: &str) -> Option<State> {
        State::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// Where a record stands: its state, and for `not_started` whether work is queued for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Queued,
    Free,
    InProgress,
    Done,
    Unknown,
}

impl Phase {
    pub fn of(state: State, queued: bool) -> Phase {
        match state {
            State::NotStarted if queued => Phase::Queued,
            State::NotStarted => Phase::Free,
            State::InProgress => Phase::InProgress,
            State::Done => Phase::Done,
            State::Unknown => Phase::Unknown,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Free => "free",
            Phase::InProgress => "in_progress",
            Phase::Done => "done",
            Phase::Unknown => "unknown",
        }
    }

    pub fn state(self) -> State {
        match self {
            Phase::Queued | Phase::Free => State::NotStarted,
            Phase::InProgress => State::InProgress,
            Phase::Done => State::Done,
            Phase::Unknown => State::Unknown,
        }
    }
}
