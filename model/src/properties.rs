//! What must hold in every state the model reaches (and what must be reachable at all).

use stateright::Property;

use crate::store::PhaseKey;
use crate::world::{Health, State};
use crate::Protocol;

pub const NEVER_TWICE: &str = "at most one effect per key that is not replay-safe";
pub const ANSWERS_KEPT: &str = "an answer told is never contradicted by the record";
pub const DONE_REACHABLE: &str = "a record is done";
pub const SETTLES: &str = "once faults stop, no record stays in progress or queued";

pub fn all() -> Vec<Property<Protocol>> {
    vec![
        Property::always(NEVER_TWICE, |_, s| never_twice(s)),
        Property::always(ANSWERS_KEPT, |_, s| answers_kept(s)),
        Property::sometimes(DONE_REACHABLE, |_, s: &State| s.rec().is_some_and(|r| r.phase == PhaseKey::Done)),
        Property::always(SETTLES, settles),
    ]
}

/// Every record admitted as not replay-safe reached the upstream's effect at most once.
pub fn never_twice(s: &State) -> bool {
    s.lives.iter().all(|life| life.safe || life.effects <= 1)
}

/// No client was told two answers for one record; no record gave way before its retention
/// passed; no attempt was sent after a client was told the record's answer (unless the node that
/// told it without recording it crashed or paused first); and the record a client was told an
/// answer for says that answer when it is done, and, unless it is replay-safe, never that its key
/// is free or queued to run again.
pub fn answers_kept(s: &State) -> bool {
    if s.contradicted || s.early {
        return false;
    }
    if s.lives.iter().any(|life| life.resent && !life.excused) {
        return false;
    }
    let Some(rec) = s.rec() else { return true };
    let life = &s.lives[rec.gen as usize];
    match life.told {
        None => true,
        Some(told) => match rec.phase {
            PhaseKey::Free | PhaseKey::Queued => life.safe,
            PhaseKey::Done => rec.response == Some(told),
            PhaseKey::InProgress | PhaseKey::Unknown => true,
        },
    }
}

/// When nothing has started and nothing has broken for `settles_within` ticks, every node runs
/// and the store answers, the key's record is settled: done, unknown or free (checked with
/// `liveness` on).
pub fn settles(model: &Protocol, s: &State) -> bool {
    let b = &model.bounds;
    let calm = b.liveness && s.calm >= b.settles_within;
    let running = s.health == Health::Up && s.nodes.iter().all(|n| n.up && !n.paused);
    if !(calm && running) {
        return true;
    }
    !s.rec().is_some_and(|r| matches!(r.phase, PhaseKey::InProgress | PhaseKey::Queued))
}

/// A state in a line, for the end of a counterexample.
pub fn summary(s: &State) -> String {
    let rec = match s.rec() {
        Some(r) => format!(
            "record {} {:?} claim {} in flight {:?} bound {:?} response {:?}",
            r.gen, r.phase, r.claim, r.in_flight, r.until, r.response
        ),
        None => "no record".into(),
    };
    let lives: Vec<String> = s.lives.iter().map(|l| format!("{} effect(s), told {:?}", l.effects, l.told)).collect();
    format!("t={} {rec}; {}", s.t, lives.join("; "))
}
