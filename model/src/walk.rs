//! Random walks through the model, for the conformance test: each write a walk makes, with the
//! store's time, what the model's store answered and the record it left.

use stateright::Model;

use crate::store::{Answer, Op, Rec, Tick};
use crate::world::{Action, State};
use crate::Protocol;

/// One write of a walk.
#[derive(Clone, Debug)]
pub struct Write {
    pub at: Tick,
    pub op: Op,
    pub answer: Answer,
    /// The key's record after it.
    pub rec: Option<Rec>,
}

/// A walk of at most `steps` actions from one of the model's starts, chosen by `seed`, and the
/// writes it made, in order.
pub fn walk(model: &Protocol, seed: u64, steps: usize) -> Vec<Write> {
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut next = move |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let starts = model.init_states();
    let mut state: State = starts[next(starts.len())].clone();
    let mut writes = Vec::new();
    for _ in 0..steps {
        let mut actions = Vec::new();
        model.actions(&state, &mut actions);
        if actions.is_empty() {
            break;
        }
        // Mostly what the nodes do and time moving on, now and then what the world does: a
        // walk that spends its requests and faults at once ends before it gets anywhere.
        let (paced, world): (Vec<Action>, Vec<Action>) = actions.iter().partition(|a| {
            matches!(a, Action::Tick | Action::Step(_) | Action::Renew(_) | Action::Sweep(_) | Action::Probed(_))
        });
        let pool = if !paced.is_empty() && (world.is_empty() || next(4) > 0) { &paced } else { &world };
        let action: Action = pool[next(pool.len())];
        let (after, applied) = crate::store::journal(|| model.next_state(&state, action));
        let Some(after) = after else { break };
        writes.extend(applied.into_iter().map(|(op, at, answer)| Write { at, op, answer, rec: None }));
        // The record each write left: the last one's is the state's; an action makes at most one.
        if let Some(last) = writes.last_mut().filter(|w| w.rec.is_none()) {
            last.rec = after.store.rec.clone();
        }
        state = after;
    }
    writes
}
