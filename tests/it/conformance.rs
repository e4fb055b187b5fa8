//! The model of the claim protocol (`model/`, docs/guarantees.md#the-model) against the real
//! stores. Random walks through the model's scenarios, each a run of requests, attempts,
//! faults, take-overs, probes and operators' actions, are replayed write by write against an
//! empty SQLite or PostgreSQL database: every write must answer as the model's store answered,
//! and leave the record as the model's store left it (its phase, claim, attempt in flight and
//! bound, lease, take-overs, last attempt, answer and cancel flag). The model checks the protocol
//! over every interleaving; this checks that the model's store is the stores the code has, so
//! that neither can drift from the other unseen. The store keeps time in the node's clock here
//! ([`LeaseClock::Node`]): the model's ticks, a second each, are the times the writes carry.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem::domain::fingerprint::Fingerprint;
use idem::domain::key::IdempotencyKey;
use idem::domain::{Actor, AttemptOutcome, ClaimToken, HistoryAction, Holder, Phase, RecordId, StopReason, Timestamp};
use idem::record::{Attempt, HistoryEntry, Record, StoredRequest, StoredResponse};
use idem::store::{
    self, Action, Admission, Admit, AttemptEnd, AttemptEnded, AttemptStarted, Cancel, Cancelled, Claim, ClaimQueued,
    LeaseClock, LeaseStatus, NewRecord, Probed, Renew, Resolution, Resolve, Retry, Store, TakeOver, TakeOverTo,
};
use idem_model::store::{Answer, Op, PhaseKey, Rec, Resp, Then, Tick};
use idem_model::walk::{walk, Write};
use idem_model::{scenarios, Protocol, Start};

use crate::common::{both_stores, Backend, Db};

/// Walks per scenario, and the most actions in each. A walk is not an exhaustive check: its
/// bounds are wider than the scenario's (more requests, faults, probes and operators' actions,
/// a later horizon), for long runs of writes.
const WALKS: u64 = 16;
const STEPS: usize = 400;
const WIDER: &str = "requests=6,faults=4,operator=3,probes=4,gens=2,horizon=60,max_attempts=3";

/// A tick as a time: one second each, from an arbitrary start.
fn at(tick: Tick) -> Timestamp {
    Timestamp::from_millis(1_700_000_000_000 + i64::from(tick) * 1_000)
}

fn ticks(n: Tick) -> Duration {
    Duration::from_secs(u64::from(n))
}

/// The answer a model's `resp` stands for: the record keeps it as its response's body.
fn response(resp: Resp) -> StoredResponse {
    StoredResponse { status: 200, headers: vec![], body: Bytes::from(format!("resp-{resp}")) }
}

fn policy(version: u8, replay_safe: bool) -> String {
    format!("v{version}-{}", if replay_safe { "safe" } else { "unsafe" })
}

fn entry(tick: Tick, action: HistoryAction) -> HistoryEntry {
    HistoryEntry { at: at(tick), actor: Actor::Operator("conformance".into()), action, note: None }
}

/// One walk replayed against `store`: the key's record, as the real store keeps it.
struct Replay<'a> {
    store: &'a Arc<dyn Store>,
    model: &'a Protocol,
    id: Option<RecordId>,
}

impl Replay<'_> {
    fn id(&self) -> RecordId {
        self.id.expect("a write to the key's record follows its admission")
    }

    fn holder(claim: u8) -> Holder {
        Holder { owner: "node".into(), token: ClaimToken(i64::from(claim)) }
    }

    /// Applies one write to the real store; what it answered, as the model says answers.
    async fn apply(&mut self, write: &Write) -> Answer {
        let b = &self.model.bounds;
        let now = at(write.at);
        match write.op {
            Op::Admit { node, claim, version, replay_safe, judged } => {
                let key = IdempotencyKey::parse("k").unwrap();
                let new = NewRecord {
                    id: RecordId::new(),
                    tenant: "default".into(),
                    key,
                    route: "payments".into(),
                    method: http::Method::POST,
                    path: "/payments".into(),
                    query: String::new(),
                    fingerprint: Fingerprint::of("payments", "POST", "/payments", "", None, b"{}"),
                    request: StoredRequest { headers: vec![], body: Bytes::from_static(b"{}") },
                    deadline_at: now + Duration::from_secs(3_600),
                    now,
                    policy_version: Some(policy(version, replay_safe).into()),
                    claim: claim.then(|| Claim {
                        owner: format!("node-{node}").into(),
                        marked_at: now,
                        lease: ticks(b.lease),
                        reach: ticks(b.reach()),
                    }),
                    tombstone_cutoff: None,
                };
                let retention_cutoff = at(judged) - ticks(b.retention);
                match self.store.admit(Admit { new, retention_cutoff }).await.unwrap() {
                    Admission::Created(record) => {
                        self.id = Some(record.id);
                        Answer::Created { claimed: record.phase() == Phase::InProgress }
                    }
                    Admission::Requeued(_) => Answer::Requeued,
                    Admission::Existing(_) => Answer::Existing,
                }
            }
            Op::Claim { node } => {
                let claim =
                    ClaimQueued { id: self.id(), owner: format!("node-{node}").into(), lease: ticks(b.lease), now };
                Answer::Claimed(self.store.claim(claim).await.unwrap().map(|token| token.0 as u8))
            }
            Op::Mark { claim, number } => {
                let started = AttemptStarted {
                    id: self.id(),
                    holder: Self::holder(claim),
                    number: u32::from(number),
                    started_at: now,
                    lease: ticks(b.lease),
                    reach: ticks(b.reach()),
                    policy_version: "marked".into(),
                };
                lease(self.store.attempt_started(started).await.unwrap(), false)
            }
            Op::Renew { claim } => {
                let renew = Renew { id: self.id(), holder: Self::holder(claim), lease: ticks(b.lease), now };
                lease(self.store.renew(renew).await.unwrap(), false)
            }
            Op::Ended { claim, attempt, then } => {
                let attempt = attempt.map(|(number, class)| Attempt {
                    number: u32::from(number),
                    started_at: now,
                    duration_ms: 1,
                    outcome: class.outcome(),
                    status: None,
                    error: None,
                    wait_ms: 0,
                    policy_version: None,
                    retry_after_ms: None,
                    unreachable: None,
                    detail: None,
                });
                let then = match then {
                    Then::Wait => AttemptEnd::Wait { not_before: now },
                    Then::Done(resp) => AttemptEnd::Done(StopReason::Success, response(resp)),
                    Then::Unknown => AttemptEnd::Unknown(StopReason::UnsafeReplay),
                    Then::Free => AttemptEnd::Free(StopReason::AttemptCap),
                    Then::Release => AttemptEnd::Release,
                };
                let ended =
                    AttemptEnded { id: self.id(), holder: Self::holder(claim), attempt, then, stream: None, now };
                let before = self.store.get(self.id()).await.unwrap().map(|r| seen(&r));
                let answered = self.store.attempt_ended(ended).await.unwrap();
                let after = self.store.get(self.id()).await.unwrap().map(|r| seen(&r));
                // A refused outcome was taken as a late one if it changed the record.
                lease(answered, answered == LeaseStatus::Lost && before != after)
            }
            Op::TakeOver { claim, expires, in_flight, to } => {
                let to = match to {
                    PhaseKey::Queued => TakeOverTo::Queued,
                    PhaseKey::Free => TakeOverTo::Free(StopReason::Deadline),
                    _ => TakeOverTo::Unknown(StopReason::UnsafeReplay),
                };
                let lost = in_flight.map(|number| Attempt {
                    number: u32::from(number),
                    started_at: now,
                    duration_ms: 1,
                    outcome: AttemptOutcome::Lost,
                    status: None,
                    error: None,
                    wait_ms: 0,
                    policy_version: None,
                    retry_after_ms: None,
                    unreachable: None,
                    detail: None,
                });
                let take_over = TakeOver {
                    id: self.id(),
                    expired: idem::record::Lease { owner: "node".into(), expires_at: at(expires) },
                    claim: ClaimToken(i64::from(claim)),
                    in_flight: in_flight.map(u32::from),
                    to,
                    lost,
                    entry: entry(write.at, HistoryAction::TakeOver(to.phase())),
                };
                if self.store.take_over(take_over).await.unwrap() {
                    Answer::Applied
                } else {
                    Answer::Refused
                }
            }
            Op::Probed { claim, executed, asked_at } => {
                let probed = Probed {
                    id: self.id(),
                    claim: ClaimToken(i64::from(claim)),
                    resolution: Some(match executed {
                        Some(resp) => Resolution::Executed(response(resp)),
                        None => Resolution::NotExecuted,
                    }),
                    asked_at: at(asked_at),
                    next_probe_at: now,
                    entry: entry(write.at, HistoryAction::Probe),
                };
                action(self.store.probed(probed).await.unwrap())
            }
            Op::Resolve { executed } => {
                let (resolution, action_name) = match executed {
                    Some(resp) => (Resolution::Executed(response(resp)), HistoryAction::ResolveExecuted),
                    None => (Resolution::NotExecuted, HistoryAction::ResolveNotExecuted),
                };
                let resolve = Resolve { id: self.id(), resolution, entry: entry(write.at, action_name) };
                action(self.store.resolve(resolve).await.unwrap())
            }
            Op::Retry => {
                let retry = Retry {
                    id: self.id(),
                    deadline_at: now + Duration::from_secs(3_600),
                    entry: entry(write.at, HistoryAction::Retry),
                };
                action(self.store.retry(retry).await.unwrap())
            }
            Op::Cancel => {
                let cancel = Cancel { id: self.id(), entry: entry(write.at, HistoryAction::Cancel) };
                match self.store.cancel(cancel).await.unwrap() {
                    Cancelled::Dequeued(_) | Cancelled::Flagged(_) => Answer::Applied,
                    Cancelled::Refused(_) => Answer::Refused,
                    Cancelled::Missing => Answer::Missing,
                }
            }
        }
    }
}

fn lease(lease: LeaseStatus, late: bool) -> Answer {
    match lease {
        LeaseStatus::Held { cancel_requested } => Answer::Held { cancel: cancel_requested },
        LeaseStatus::Lost => Answer::Lost { late },
    }
}

fn action(action: Action) -> Answer {
    match action {
        Action::Applied(_) => Answer::Applied,
        Action::Refused(_) => Answer::Refused,
        Action::InFlight(_, left) => Answer::InFlight(left.as_secs() as Tick),
        Action::Missing => Answer::Missing,
    }
}

/// The columns the model keeps, as the real record has them.
fn seen(record: &Record) -> String {
    let last = record.attempts.last().map(|a| (a.number, a.outcome == AttemptOutcome::Lost));
    let response = record.response.as_ref().map(|r| String::from_utf8_lossy(&r.body).into_owned());
    format!(
        "{:?} claim {} in flight {:?} until {:?} lease {:?} takeovers {} last {:?} response {:?} cancel {}",
        record.phase(),
        record.claim.0,
        record.in_flight.map(|(n, _)| n),
        record.in_flight_until,
        record.lease.as_ref().map(|l| l.expires_at),
        record.takeovers,
        last,
        response,
        record.cancel_requested
    )
}

/// The same, as the model's store keeps it.
fn modelled(rec: &Rec) -> String {
    let response = rec.response.map(|resp| String::from_utf8_lossy(&response(resp).body).into_owned());
    format!(
        "{:?} claim {} in flight {:?} until {:?} lease {:?} takeovers {} last {:?} response {:?} cancel {}",
        rec.phase.phase(),
        rec.claim,
        rec.in_flight.map(u32::from),
        rec.until.map(at),
        rec.lease.map(|l| at(l.expires)),
        rec.takeovers,
        rec.last.map(|l| (u32::from(l.number), l.lost)),
        response,
        rec.cancel
    )
}

/// What kind of write `op` is, and what kind of answer `answer`: the walks must make every kind
/// of write, and hear each answer that tells a guard at work.
fn kinds(op: &Op, answer: &Answer) -> (&'static str, &'static str) {
    let op = match op {
        Op::Admit { .. } => "admit",
        Op::Claim { .. } => "claim",
        Op::Mark { .. } => "mark",
        Op::Renew { .. } => "renew",
        Op::Ended { .. } => "ended",
        Op::TakeOver { .. } => "take-over",
        Op::Probed { .. } => "probed",
        Op::Resolve { .. } => "resolve",
        Op::Retry => "retry",
        Op::Cancel => "cancel",
    };
    let answer = match answer {
        Answer::Created { .. } => "created",
        Answer::Requeued => "requeued",
        Answer::Existing => "existing",
        Answer::Claimed(Some(_)) => "claimed",
        Answer::Claimed(None) => "not claimed",
        Answer::Held { .. } => "held",
        Answer::Lost { late: true } => "late",
        Answer::Lost { late: false } => "lost",
        Answer::Applied => "applied",
        Answer::Refused => "refused",
        Answer::InFlight(_) => "in flight",
        Answer::Missing => "missing",
    };
    (op, answer)
}

/// Every scenario's walks (from an empty store) replayed on `backend`.
async fn the_models_store_is_the_real_store(backend: Backend) {
    let mut writes = 0;
    let mut seen_kinds = std::collections::BTreeMap::new();
    for mut scenario in scenarios::all().into_iter().filter(|s| s.starts == [Start::Fresh]) {
        scenario.bounds = scenario.bounds.with(WIDER).unwrap();
        let model = Protocol::new(&scenario, None);
        for seed in 0..WALKS {
            let db = Db::new(backend).await;
            let store = store::open_with(&db.url, LeaseClock::Node).await.unwrap();
            let mut replay = Replay { store: &store, model: &model, id: None };
            let walked = walk(&model, seed, STEPS);
            for (i, write) in walked.iter().enumerate() {
                let answered = replay.apply(write).await;
                let context = || {
                    let steps: Vec<String> =
                        walked[..=i].iter().map(|w| format!("t={} {:?} → {:?}", w.at, w.op, w.answer)).collect();
                    format!("scenario {} seed {seed}, write {}:\n{}", scenario.name, i + 1, steps.join("\n"))
                };
                assert_eq!(answered, write.answer, "the store answered otherwise than the model: {}", context());
                if let (Some(rec), Some(id)) = (&write.rec, replay.id) {
                    let record = store.get(id).await.unwrap().expect("the key's record");
                    assert_eq!(seen(&record), modelled(rec), "the record differs from the model's: {}", context());
                }
                writes += 1;
                *seen_kinds.entry(kinds(&write.op, &write.answer)).or_insert(0) += 1;
            }
            store.close().await;
        }
    }
    assert!(writes > 2_000, "the walks made only {writes} writes");
    let made: std::collections::BTreeSet<_> = seen_kinds.keys().map(|(op, _)| *op).collect();
    for op in ["admit", "claim", "mark", "renew", "ended", "take-over", "probed", "resolve", "retry", "cancel"] {
        assert!(made.contains(op), "no walk made a {op}: {seen_kinds:?}");
    }
    for guard in [
        ("admit", "requeued"),
        ("admit", "existing"),
        ("mark", "lost"),
        ("ended", "late"),
        ("ended", "lost"),
        ("take-over", "applied"),
        ("take-over", "refused"),
        ("probed", "in flight"),
        ("probed", "applied"),
        ("retry", "applied"),
    ] {
        assert!(seen_kinds.contains_key(&guard), "no walk heard {guard:?}: {seen_kinds:?}");
    }
    eprintln!("{writes} writes replayed: {seen_kinds:?}");
}

both_stores!(the_models_store_is_the_real_store);
