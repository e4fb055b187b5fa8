//! The attempts of one execution: each stored before it is sent and after it ends, the policy
//! asked before and after each, the waits between them spent renewing the lease.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;
use tracing::{info_span, warn, Instrument};

use super::job::Job;
use super::{Inner, Outcome};
use crate::config::Policy;
use crate::domain::clock::Moment;
use crate::domain::Timestamp;
use crate::domain::{Class, StopReason};
use crate::observe::metrics::{self, Laps, Stage};
use crate::policy::{self, Decision, Ended, Execution, Observed};
use crate::record::{Attempt, Record, StoredResponse, StreamFacts};
use crate::store::{self, AttemptStarted, LeaseStatus};
use crate::upstream::{self, Answer, Failure, Head, Outbound};

/// Where an execution stands between attempts.
pub(super) struct Progress {
    /// When the request arrived as its route's deadline counts: earlier than it did if the client
    /// shortened its deadline, so that the time left always ends at the record's `deadline_at`.
    pub(super) arrival: Timestamp,
    /// The number of the last attempt stored with the record (all executions).
    pub(super) number: u32,
    pub(super) wait_before: Duration,
    /// What the policy's next decisions depend on: attempts made, the last wait, what they showed.
    pub(super) run: Execution,
    /// The last attempt's response, if one came.
    pub(super) last_response: Option<StoredResponse>,
    /// What arrived of a streamed answer that was cut: kept with the `unknown` record.
    pub(super) partial: Option<StoredResponse>,
    /// How the last attempt's answer streamed, if it did: stored with the outcome.
    pub(super) stream: Option<StreamFacts>,
    /// The stages of a new key that went out at once and is waited for ([`Stage`]).
    pub(super) laps: Option<Laps>,
    /// When the upstream's last answer came (its first body byte, for a streamed one): where
    /// the upstream's stage ends.
    pub(super) upstream_answered: Option<Instant>,
    /// Why the last attempt could not reach the upstream, if it could not: told with a freed key.
    pub(super) unreachable: Option<String>,
}

impl Progress {
    pub(super) fn new(record: &Record, deadline: Duration) -> Progress {
        let arrival = record.deadline_at - deadline;
        Progress {
            arrival,
            number: record.attempts.len() as u32,
            wait_before: Duration::ZERO,
            // Attempts an earlier worker made before a take-over count against `max_attempts`,
            // as the deadline they spent does.
            run: Execution::resumed(record.attempts.iter().filter(|a| a.started_at >= arrival).count() as u32),
            last_response: None,
            partial: None,
            stream: None,
            laps: None,
            upstream_answered: None,
            unreachable: None,
        }
    }
}

/// Why the attempts stopped, and so how the execution ends.
pub(super) enum End {
    /// The policy (or a cancel) stopped them: settle the record, with the last attempt if it is
    /// not stored yet.
    Stop(StopReason, Option<Attempt>),
    /// Hand the record back to the queue between attempts, for a new claim to continue.
    HandBack(HandBack),
    /// The record is no longer this worker's (or the store failed): its record is the answer.
    Lost,
}

/// Why an execution hands its record back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HandBack {
    /// The process is stopping.
    Shutdown,
    /// A renewal failed, or found the claim taken, while the last attempt was in flight: no
    /// further attempt goes under this claim.
    ClaimInDoubt,
}

/// An attempt about to be sent: when it started, the place it holds on its route, how long the
/// policy lets it take, and the instant past which its first byte must not leave.
struct Begun {
    started: Timestamp,
    in_flight: Option<OwnedSemaphorePermit>,
    limit: Duration,
    send_by: Moment,
}

/// An attempt that ended: what the upstream answered (or what went wrong), and how long it took
/// — or, when its answer streams, its head and first part, the rest still to read.
pub(super) struct Sent {
    result: Result<Answer, Failure>,
    /// When it was handed to the upstream client, and how long its answer took from there.
    at: Instant,
    took: Duration,
    pub(super) started: Timestamp,
    pub(super) span: tracing::Span,
    pub(super) flowing: Option<Flowing>,
}

/// An answer that streams, past its first body byte: from here on it is never retried.
pub(super) struct Flowing {
    pub(super) head: Head,
    pub(super) first: bytes::Bytes,
    /// The attempt's place on its route, held until the stream ends.
    pub(super) in_flight: Option<OwnedSemaphorePermit>,
    /// When the attempt was sent, and how long its first byte took.
    pub(super) sent_at: Instant,
    pub(super) first_byte: Duration,
}

/// What one attempt's send got: the whole answer (or what went wrong), or a stream under way.
enum Got {
    Whole(Answer),
    Flowing(Head, bytes::Bytes),
}

impl Inner {
    /// Runs attempts until the policy stops, then settles (or hands back) the record.
    /// `reserved`: admitted claimed, with its place among the route's attempts and the stages
    /// of the new key so far.
    pub(super) async fn attempts(&self, job: &Job<'_>, reserved: Option<(Reserved, Option<Laps>)>) -> Outcome {
        let mut p = Progress::new(job.record, job.chosen.retry.deadline);
        let reserved = reserved.map(|(reserved, laps)| {
            p.laps = laps;
            reserved
        });
        let Err(end) = self.attempt_loop(job, &mut p, reserved).await;
        match end {
            End::Stop(stop, attempt) => self.finish_after(job, attempt, stop, p).await,
            End::HandBack(why) => self.release(job.record, job.holder, why).await,
            End::Lost => Outcome::Lost,
        }
    }

    async fn attempt_loop(
        &self,
        job: &Job<'_>,
        p: &mut Progress,
        mut reserved: Option<Reserved>,
    ) -> Result<Infallible, End> {
        self.owed_wait(job, p).await?;
        loop {
            let begun = self.begin(job, p, reserved.take()).await?;
            let sent = self.send(job, p, begun).await;
            if let Some(laps) = p.laps.as_mut().filter(|_| p.upstream_answered.is_none()) {
                laps.lap_at(Stage::ToSend, sent.at);
            }
            p.upstream_answered = Some(sent.at + sent.took);
            if sent.flowing.is_some() {
                return Err(self.stream_through(job, p, sent).await);
            }
            let wait = self.judge(job, p, sent)?;
            self.wait_to_retry(job, p, wait).await?;
        }
    }

    /// Taken over (or handed back) in the middle of a wait: the rest of it is still owed.
    async fn owed_wait(&self, job: &Job<'_>, p: &mut Progress) -> Result<(), End> {
        let record = job.record;
        let Some(not_before) = record.not_before else { return Ok(()) };
        if let Some(rest) = Some(not_before - self.clock.now()).filter(|rest| !rest.is_zero()) {
            self.wait(job, rest).await.then()?;
        }
        // The next attempt follows the whole wait, wherever it was spent: it is recorded as
        // such, and feeds decorrelated jitter as it would have.
        if let Some(last) = record.attempts.last() {
            let ended = last.started_at + Duration::from_millis(last.duration_ms);
            let wait = not_before - ended;
            p.wait_before = wait;
            p.run.waited(wait);
        }
        Ok(())
    }

    /// Takes a place for the next attempt, asks the policy whether it may go, and marks it in the
    /// store as about to be sent — unless it was admitted with that mark (`reserved`). The mark
    /// starts the attempt's send window: its first byte leaves within `worker.send_window` of the
    /// moment the mark's write was sent, and within the claim's trusted lease, or not at all.
    async fn begin(&self, job: &Job<'_>, p: &mut Progress, reserved: Option<Reserved>) -> Result<Begun, End> {
        let Job { record, route, chosen, .. } = job;
        // `marked`: admitted already claimed, with this first attempt marked as about to be
        // sent in the same commit, so nothing more is written before sending it.
        let (started, in_flight, marked) = match reserved {
            Some(Reserved { place, marked }) => {
                (record.in_flight.map_or_else(|| self.clock.now(), |(_, at)| at), Some(place), Some(marked))
            }
            None => {
                // A place among the route's attempts in flight, held for this attempt only.
                let place = self.renewing(job.lease(), job.route.guard().attempts.clone().acquire_owned()).await.ok();
                (self.clock.now(), place, None)
            }
        };
        // `started` is the mark's time in the node's clock; this is the same instant on its
        // monotonic one, from which the mark's lease is trusted and its send window runs.
        let started_here = Moment::now();
        let cancelled = job.signal.raised.load(Ordering::SeqCst);
        let switched = self.switches.switched(&route.name);
        let limit = p
            .run
            .next_attempt(chosen.retry, since(p.arrival, started), cancelled, switched)
            .map_err(|stop| End::Stop(stop, None))?;
        if self.drain.is_stopping() && marked.is_none() {
            return Err(End::HandBack(HandBack::Shutdown));
        }
        if job.signal.is_superseded() {
            return Err(End::Lost);
        }
        if marked.is_none() && job.trust.in_doubt() {
            return Err(End::HandBack(HandBack::ClaimInDoubt));
        }
        let made = p.run.sending();
        p.number += 1;
        job.reply.attempted(p.number);
        let marked = match marked {
            Some(marked) => marked,
            None => {
                let mark = AttemptStarted {
                    id: record.id,
                    holder: job.holder.clone(),
                    number: p.number,
                    started_at: started,
                    lease: self.lease,
                    reach: self.reach(limit),
                    policy_version: chosen.version.clone(),
                };
                let marked = match self.store.attempt_started(mark).await {
                    Ok(lease) => lease,
                    // Its answer was lost (the connection died under it, the primary failed over):
                    // the mark may or may not be committed. Never taken as "not written".
                    Err(e) => self.mark_in_doubt(job, p.number, &e).await?,
                };
                match marked {
                    LeaseStatus::Held { cancel_requested: false } => job.trust.renewed(started_here, self.trust()),
                    LeaseStatus::Held { cancel_requested: true } => return Err(End::Stop(StopReason::Cancelled, None)),
                    LeaseStatus::Lost => return Err(End::Lost),
                }
                started_here
            }
        };
        if made == 1 {
            job.charges.first_attempt();
        }
        let send_by = (marked + self.send_window).min(job.trust.trusted_until());
        Ok(Begun { started, in_flight, limit, send_by })
    }

    /// Sends the attempt, keeping the lease alive while it is in flight. An answer that streams
    /// (docs/concepts.md) and whose status ends the execution is read up to its first body byte only,
    /// within the attempt's limit: until then the policy holds; after it, the stream is read
    /// through. Any other answer is read whole, as before.
    async fn send(&self, job: &Job<'_>, p: &Progress, begun: Begun) -> Sent {
        let Job { record, route, chosen, .. } = job;
        let Begun { started, in_flight, limit, send_by } = begun;
        let mut told = job.credentials.clone();
        upstream::tell_deadline(&mut told, route.deadline_header.as_ref(), limit);
        upstream::tell_attempt(&mut told, route.attempt_header.as_ref(), record.id, job.holder.token, p.number);
        let clock = Instant::now();
        let until = tokio::time::Instant::now() + limit;
        let sent = async {
            let request = Outbound::for_route(
                route,
                &record.method,
                job.url.clone(),
                &record.request.headers,
                &told,
                record.request.body.clone(),
            );
            let head = self.upstream.send_head(request, until, Some(send_by)).await?;
            let settles =
                matches!(chosen.retry.classify(Observed::Response(head.status)), Class::Success | Class::Final);
            if !(head.streamed && settles) {
                return Ok(head.whole(until).await.map(Got::Whole)?);
            }
            let mut head = head;
            match tokio::time::timeout_at(until, head.part()).await {
                Ok(Ok(Some(first))) => Ok(Got::Flowing(head, first)),
                // An empty body: there is nothing to stream.
                Ok(Ok(None)) => Ok(head.whole(until).await.map(Got::Whole)?),
                Ok(Err(observed)) => Err(observed.into()),
                Err(_) => Err(Failure::from(Observed::TimedOut)),
            }
        };
        // A CLIENT span, with OpenTelemetry's HTTP attributes: what a trace backend shows of a
        // call to another service.
        let span = info_span!(
            "attempt",
            otel.kind = "client",
            http.request.method = %record.method,
            server.address = job.url.host_str().unwrap_or("-"),
            server.port = job.url.port_or_known_default(),
            url.path = job.url.path(),
            http.request.resend_count = p.number.saturating_sub(1),
            http.response.status_code = tracing::field::Empty,
            number = p.number,
            wait_ms = p.wait_before.as_millis() as u64,
            class = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let got = self.renewing(job.lease(), sent).instrument(span.clone()).await;
        let took = clock.elapsed();
        match got {
            Ok(Got::Flowing(head, first)) => {
                let answer = Answer {
                    response: StoredResponse {
                        status: head.status,
                        headers: head.headers.clone(),
                        body: Default::default(),
                    },
                    retry_after: head.retry_after.clone(),
                };
                let flowing = Flowing { head, first, in_flight, sent_at: clock, first_byte: took };
                Sent { result: Ok(answer), at: clock, took, started, span, flowing: Some(flowing) }
            }
            Ok(Got::Whole(answer)) => {
                drop(in_flight);
                Sent { result: Ok(answer), at: clock, took, started, span, flowing: None }
            }
            Err(failure) => {
                drop(in_flight);
                Sent { result: Err(failure), at: clock, took, started, span, flowing: None }
            }
        }
    }

    /// Classifies the attempt that ended and asks the policy what follows: the wait before the
    /// next attempt, or the end of the execution (with this attempt, still to be stored).
    fn judge(&self, job: &Job<'_>, p: &mut Progress, sent: Sent) -> Result<(Attempt, Duration), End> {
        let Job { route, chosen, .. } = job;
        let Sent { result, took, started, span, .. } = sent;
        let (observed, answer, cause) = match result {
            Ok(answer) => (Observed::Response(answer.response.status), Some(answer), None),
            Err(Failure { observed, cause }) => (observed, None, cause),
        };
        let retry_after = self.retry_after(answer.as_ref());
        let switched = self.switches.switched(&route.name);
        let (class, decision) = p.run.ended(
            chosen.retry,
            chosen.replay_safe,
            Ended {
                observed,
                retry_after,
                elapsed: since(p.arrival, self.clock.now()),
                cancelled: job.signal.raised.load(Ordering::SeqCst),
                // An isolated route's upstream is as good as behind an open circuit.
                circuit_open: switched.isolated || route.circuit_open(),
                retries_off: switched.retries_off,
            },
            rand::random::<f64>,
            || job.charges.take_retry(),
        );
        let mut attempt = stored_attempt(p, started, took, class, answer.as_ref(), observed, retry_after, chosen);
        span.record("class", class.as_str());
        if let Some(status) = attempt.status {
            span.record("status", status);
            span.record("http.response.status_code", status);
        }
        // Why the upstream could not be reached, for the record and for the answer that says so.
        // The connection's own words for the record's operator view and the log; the kind of
        // failure for the client's answer.
        attempt.unreachable = cause.as_ref().map(|cause| format!("route {}: {}", route.name, cause.why));
        attempt.detail = cause.as_ref().map(|cause| format!("route {}: {}", route.name, cause.detail));
        span.in_scope(|| match &attempt.detail {
            Some(detail) => tracing::warn!(
                attempt = p.number,
                outcome = class.as_str(),
                took_ms = attempt.duration_ms,
                wait_ms = attempt.wait_ms,
                detail,
                "attempt: the upstream could not be reached"
            ),
            None => tracing::info!(
                attempt = p.number,
                outcome = class.as_str(),
                status = attempt.status,
                took_ms = attempt.duration_ms,
                wait_ms = attempt.wait_ms,
                "attempt"
            ),
        });
        p.unreachable = attempt.unreachable.clone();
        metrics::attempt(&route.name, chosen.version, class, took);
        route.observe(took);
        p.last_response = answer.map(|a| a.response);
        match decision {
            Decision::Stop(stop) => Err(End::Stop(stop, Some(attempt))),
            Decision::RetryAfter(wait) => Ok((attempt, wait)),
        }
    }

    /// The upstream's `Retry-After`, if it sent one the policy can read.
    fn retry_after(&self, answer: Option<&Answer>) -> Option<Duration> {
        let value = answer?.retry_after.as_deref()?;
        let parsed = policy::parse_retry_after(value, self.clock.system_time());
        if parsed.is_none() {
            warn!(value, "ignoring an unparseable Retry-After from the upstream");
        }
        parsed
    }

    /// Stores the attempt that ended and the time the next one may start, then waits for it.
    async fn wait_to_retry(
        &self,
        job: &Job<'_>,
        p: &mut Progress,
        (attempt, wait): (Attempt, Duration),
    ) -> Result<(), End> {
        let record = job.record;
        let now = self.clock.now();
        let then = store::AttemptEnd::Wait { not_before: now + wait };
        match self.store.attempt_ended(self.ended(record, job.holder, Some(attempt), then, now)).await {
            Ok(LeaseStatus::Held { cancel_requested: false }) => {}
            Ok(LeaseStatus::Held { cancel_requested: true }) => return Err(End::Stop(StopReason::Cancelled, None)),
            Ok(LeaseStatus::Lost) => return Err(End::Lost),
            Err(e) => {
                warn!(error = %e, "could not record an attempt's outcome");
                return Err(End::Lost);
            }
        }
        if job.trust.in_doubt() {
            return Err(End::HandBack(HandBack::ClaimInDoubt));
        }
        self.wait(job, wait).await.then()?;
        p.run.waited(wait);
        p.wait_before = wait;
        Ok(())
    }
}

/// An attempt admitted already claimed: its place among the route's attempts, and the instant
/// the write that marked it was sent, which starts its send window.
pub(super) struct Reserved {
    pub(super) place: OwnedSemaphorePermit,
    pub(super) marked: Moment,
}

/// The attempt as it is stored with the record.
#[allow(clippy::too_many_arguments)]
pub(super) fn stored_attempt(
    p: &Progress,
    started: Timestamp,
    took: Duration,
    class: Class,
    answer: Option<&Answer>,
    observed: Observed,
    retry_after: Option<Duration>,
    chosen: &Policy<'_>,
) -> Attempt {
    Attempt {
        number: p.number,
        started_at: started,
        duration_ms: took.as_millis() as u64,
        outcome: class.into(),
        status: answer.map(|a| a.response.status),
        error: observed.error(),
        wait_ms: p.wait_before.as_millis() as u64,
        policy_version: Some(chosen.version.clone()),
        retry_after_ms: retry_after.map(|ra| ra.as_millis().min(u64::MAX as u128) as u64),
        unreachable: None,
        detail: None,
    }
}

pub(super) fn since(arrival: Timestamp, now: Timestamp) -> Duration {
    now - arrival
}
