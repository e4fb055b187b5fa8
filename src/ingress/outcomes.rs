//! Answers from a record: the outcome of the execution this request drove, or, for a request
//! that did not drive one (a duplicate, or one whose execution another worker took), the record
//! as it stands once it settles or the wait runs out — replayed, 409 with when to come back,
//! 502 unknown, or freed.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::Json;

use super::answers::{freed, http_date, outcome_response, stored_response, Answer};
use super::{Ingress, EXPIRES_HEADER};
use crate::domain::{AnswerKind, Phase, State};
use crate::observe::metrics;
use crate::policy::{outcome_eta, Pending};
use crate::problem::{Problem, STATUS_HEADER};
use crate::record::Record;
use crate::runtime::ServedRoute;
use crate::worker::{Awaited, Outcome, Told};

/// How often a waiting request re-reads its record anyway, should an announcement of its
/// settlement by another node be lost.
const WAIT_POLL: Duration = Duration::from_secs(1);

impl Ingress {
    /// This request owns the record, which a worker executes: answer with the outcome, or at
    /// once when the client asked to be answered asynchronously (`outcome` is `None` then).
    /// Waiting for the outcome runs the execution on this request's task; when the wait ends
    /// first (its patience ran out) or the request is dropped (its client left), the execution
    /// goes on on a task of its own ([`Awaited`]).
    /// An execution that went out at once tells its stages with its outcome, and they are
    /// recorded with the whole way (`metrics::Stage`) once the answer is built. A streamed answer
    /// tells none: it is told at its first byte, before the execution keeps any.
    /// `route`: the request's, with the configuration it is served under, read once.
    pub(super) async fn executing(&self, route: &ServedRoute, record: &Record, outcome: Option<Awaited>) -> Answer {
        super::access::record(record.id);
        let Some(outcome) = outcome else {
            super::access::kind(super::access::Kind::Accepted);
            let location = format!("/_idem/requests/{}", crate::domain::key::path_segment(&record.key));
            let mut response =
                (StatusCode::ACCEPTED, Json(record.to_json(crate::record::View::Listed))).into_response();
            let headers = response.headers_mut();
            headers.insert(STATUS_HEADER, HeaderValue::from_static(record.state.as_str()));
            headers.insert("preference-applied", HeaderValue::from_static("respond-async"));
            if let Ok(v) = HeaderValue::from_str(&location) {
                headers.insert(header::LOCATION, v);
            }
            return Ok(response);
        };
        let id = record.id;
        // The record becomes done after it arrived, so its retention ends later than this entry's.
        let expires_at = route.config().lifetime_of(&record.route).expires_at(record.created_at);
        let patience = record.deadline_at - self.clock.now() + Duration::from_secs(5);
        match tokio::time::timeout(patience, outcome).await {
            Ok(Some(Told { outcome, laps, attempts })) if !matches!(outcome, Outcome::Lost) => {
                super::access::attempts(attempts);
                if let Outcome::Done(_, response) = &outcome {
                    self.keep_for_replays(record, response, expires_at);
                }
                debug_assert!(laps.is_none() || !matches!(outcome, Outcome::Streaming(_)));
                let answer = outcome_response(outcome);
                if let Some(laps) = laps {
                    laps.answered();
                }
                answer
            }
            // Another worker (of this node or another) runs it, or this request's patience ran out
            // (the execution goes on without it): wait for it like a duplicate.
            _ => match self.records.get(id).await {
                Ok(Some(record)) => {
                    let left = record.deadline_at - self.clock.now();
                    // Its outcome answers this request first-hand: it is not a replay.
                    self.answer(route, record, Some(left + Duration::from_secs(1)), false).await
                }
                Ok(None) => Err(Problem::not_found()),
                Err(e) => Err(Problem::store(&e)),
            },
        }
    }

    /// A request for a key this request does not own (same fingerprint): replay, wait, refuse.
    pub(super) async fn answer_existing(&self, route: &ServedRoute, record: Record, wait: Option<Duration>) -> Answer {
        self.answer(route, record, wait, true).await
    }

    /// Answers from the record, after waiting up to `wait` for it to settle. A `done` answer is
    /// marked as a replay unless this request is the one whose execution produced it.
    /// `route` is the request's; `record`'s own route is judged under the same configuration.
    async fn answer(&self, route: &ServedRoute, mut record: Record, wait: Option<Duration>, replay: bool) -> Answer {
        let config = route.config();
        super::access::record(record.id);
        if let (Some(wait), Phase::Queued | Phase::InProgress) = (wait, record.phase()) {
            if let Some(attached) = self.attached(&record) {
                return Ok(attached);
            }
            let until = tokio::time::Instant::now() + wait;
            record = self.wait_for(&record, wait, true).await?.ok_or_else(Problem::not_found)?;
            if let Some(attached) = self.attached(&record) {
                return Ok(attached);
            }
            // Its answer was streaming here and could not be joined: it ended as we looked, or
            // no longer holds its beginning. The record settles soon: wait for that instead.
            if matches!(record.phase(), Phase::Queued | Phase::InProgress) {
                let left = until.saturating_duration_since(tokio::time::Instant::now());
                record = self.wait_for(&record, left, false).await?.ok_or_else(Problem::not_found)?;
            }
        }
        let kind = match record.phase() {
            Phase::Done => AnswerKind::Replay,
            Phase::Unknown => AnswerKind::Unknown,
            Phase::Queued | Phase::InProgress => AnswerKind::InProgress,
            Phase::Free => AnswerKind::Freed,
        };
        // The record's route as this request is served; `None` for a route no longer configured,
        // whose answers are not counted.
        let records_route = route.snapshot().route_named(&record.route);
        if replay {
            metrics::answered(&record.route, kind);
            match (record.phase(), &records_route) {
                (Phase::Done, Some(route)) => route.count_replay(),
                (Phase::Queued | Phase::InProgress, Some(route)) => route.count_conflict(),
                _ => {}
            }
        }
        if let Some(spent) = self.records.spent(config, &record) {
            return Err(spent);
        }
        match record.phase() {
            Phase::Done => match &record.response {
                // Streamed past `max_stored_body`: done, but there is nothing to replay.
                Some(_) if record.stream.as_ref().is_some_and(|s| !s.stored) => Err(Problem::response_not_stored()),
                Some(response) => {
                    let expires_at = config.lifetime_of(&record.route).expires_at(record.completed());
                    self.keep_for_replays(&record, response, expires_at);
                    let mut answer = stored_response(response, replay);
                    answer.headers_mut().insert(EXPIRES_HEADER, http_date(expires_at));
                    Ok(answer)
                }
                None => Err(Problem::outcome_unknown().state(State::Done)),
            },
            Phase::Unknown => Err(Problem::outcome_unknown().state(State::Unknown)),
            Phase::Queued | Phase::InProgress => {
                let pending = Pending {
                    now: self.clock.now(),
                    in_flight_since: record.in_flight.map(|(_, started)| started),
                    // The limit of the policy the record runs under: a canary's, maybe.
                    attempt_limit: records_route.as_ref().map(|route| {
                        route.policy_of(record.policy_version.as_ref(), route.own_policy()).retry.per_try_timeout
                    }),
                    next_attempt_at: record.not_before,
                    deadline_at: record.deadline_at,
                };
                let eta = outcome_eta(pending, records_route.and_then(|route| route.pace()));
                Err(Problem::in_progress(eta).state(record.state))
            }
            // Freed while we waited: the client may send it again, and it will execute afresh.
            Phase::Free => {
                Err(freed(record.stop_reason, record.attempts.last().and_then(|a| a.unreachable.as_deref())))
            }
        }
    }

    /// Waits up to `max` for a record to leave `in_progress`/queued, or, when the request can
    /// `attach`, for its answer to start streaming here; `None` if it disappeared.
    pub(super) async fn wait_for(
        &self,
        record: &Record,
        max: Duration,
        attach: bool,
    ) -> Result<Option<Record>, Problem> {
        let id = record.id;
        let until = tokio::time::Instant::now() + max;
        let _counted = metrics::waiting(&record.route);
        // Another node may settle it: have it announced.
        self.records.watch(id).await.map_err(|e| Problem::store(&e))?;
        // At shutdown, waiting ends: the client is answered with where its request stands.
        let mut stopping = self.stopping.clone();
        loop {
            let watch = self.worker.watch(id);
            let notified = watch.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let record = self.records.get(id).await.map_err(|e| Problem::store(&e))?;
            let Some(record) = record else {
                return Ok(None);
            };
            let now = tokio::time::Instant::now();
            let pending = matches!(record.phase(), Phase::Queued | Phase::InProgress);
            // Its answer streaming here: the request attaches to it rather than wait for the end.
            let streaming = attach && pending && self.worker.streaming(id);
            if !pending || streaming || now >= until || *stopping.borrow_and_update() {
                return Ok(Some(record));
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep((until - now).min(WAIT_POLL)) => {}
                _ = stopping.changed() => {}
            }
        }
    }
}
