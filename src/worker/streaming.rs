//! A streamed answer past its first body byte (docs/concepts.md): the client is answered at once with a
//! reader of the [`Tap`], and the execution reads the upstream to its end whatever the client
//! does — a client that leaves stops nothing. How the stream ends settles the record: whole, it
//! is `done`; cut, stalled past `stream_idle_timeout` or out of deadline, it is `unknown` (or
//! free on a replay-safe route), and never sent again within this answer.

use std::sync::atomic::Ordering;

use tracing::Instrument;

use super::attempts::{since, stored_attempt, End, Progress, Sent};
use super::job::Job;
use super::{Flow, Inner, Outcome};
use crate::domain::{AttemptError, BudgetScope, StopReason};
use crate::observe::metrics;
use crate::policy::{Decision, Ended, Observed};
use crate::problem::Problem;
use crate::record::{StoredResponse, StreamFacts};
use crate::stream::{self, Tap};

/// Why a stream ended short.
#[derive(Debug, Clone, Copy)]
enum Short {
    /// The upstream broke the connection mid-body.
    Cut,
    /// Nothing arrived for `stream_idle_timeout`.
    Idle,
    /// The request's deadline passed.
    Deadline,
}

impl Short {
    fn stop(self) -> StopReason {
        match self {
            Short::Cut => StopReason::StreamCut,
            Short::Idle => StopReason::StreamIdleTimeout,
            Short::Deadline => StopReason::Deadline,
        }
    }

    /// How the attempt ended, as stored with it.
    fn error(self) -> AttemptError {
        match self {
            Short::Cut => AttemptError::StreamCut,
            Short::Idle => AttemptError::StreamIdleTimeout,
            Short::Deadline => AttemptError::Deadline,
        }
    }

    fn why(self) -> &'static str {
        match self {
            Short::Cut => "the upstream cut the stream",
            Short::Idle => "the upstream sent nothing for stream_idle_timeout",
            Short::Deadline => "the request's deadline passed",
        }
    }
}

impl Inner {
    /// Passes a streamed answer to its client as it arrives while keeping it for the record,
    /// then ends the execution: the stop to settle with, and the attempt to store; how the stream
    /// went is left in `p.stream`, for the outcome's write.
    pub(super) async fn stream_through(&self, job: &Job<'_>, p: &mut Progress, sent: Sent) -> End {
        let Job { record, route, chosen, .. } = job;
        let Sent { started, span, flowing, .. } = sent;
        let Some(flowing) = flowing else { return End::Lost };
        let super::attempts::Flowing { mut head, first, in_flight, sent_at, first_byte } = flowing;
        let tap = Tap::new(route.max_stored_body as u64, stream::WINDOW);
        // A fresh tap takes readers; the client's is attached before any part can be dropped.
        let flow = Flow { status: head.status, headers: head.headers.clone(), event_stream: head.event_stream, tap };
        let reader = flow.attach();
        let tap = flow.tap.clone();
        tap.push(first).await;
        self.streams.insert(record.id, flow);
        // Duplicates waiting for the record are woken to attach to its stream.
        self.settled.settled(record.id);
        if let Some(streamed) = reader {
            job.reply.send(Outcome::Streaming(streamed));
        }

        let idle = chosen.retry.stream_idle_timeout;
        let left = record.deadline_at - self.clock.now();
        let deadline = tokio::time::Instant::now() + left;
        let read = async {
            loop {
                match tokio::time::timeout(idle, head.part()).await {
                    Ok(Ok(Some(part))) => tap.push(part).await,
                    Ok(Ok(None)) => return Ok(()),
                    Ok(Err(_)) => return Err(Short::Cut),
                    Err(_) => return Err(Short::Idle),
                }
            }
        };
        // The deadline bounds the whole stream, the time a slow reader holds the upstream back
        // included: a client that stops reading a long answer cannot keep it open for ever.
        let read = async { tokio::time::timeout_at(deadline, read).await.unwrap_or(Err(Short::Deadline)) };
        let ended = self.renewing(job.lease(), read).instrument(span.clone()).await;
        let took = sent_at.elapsed();
        drop(in_flight);

        let status = head.status;
        let observed = match ended {
            Ok(()) => Observed::Response(status),
            // What reached the client may have been acted on: a cut is an ambiguous outcome.
            Err(_) => Observed::Broken,
        };
        let (class, decision) = p.run.ended(
            chosen.retry,
            chosen.replay_safe,
            Ended {
                observed,
                retry_after: None,
                elapsed: since(p.arrival, self.clock.now()),
                cancelled: job.signal.raised.load(Ordering::SeqCst),
                circuit_open: false,
                retries_off: false,
            },
            // Nothing is retried within a streamed answer: no wait is drawn, no budget taken.
            || 0.0,
            || Err(BudgetScope::Route),
        );
        let mut attempt = stored_attempt(p, started, took, class, None, observed, None, chosen);
        attempt.status = Some(status);
        let stop = match ended {
            Ok(()) => {
                tap.finish(stream::End::Complete);
                p.last_response = Some(StoredResponse {
                    status,
                    headers: head.headers.clone(),
                    body: tap.body().unwrap_or_default(),
                });
                match decision {
                    Decision::Stop(stop) => stop,
                    Decision::RetryAfter(_) => StopReason::Success,
                }
            }
            Err(short) => {
                let problem = Problem::stream_cut(short.why(), chosen.replay_safe).for_key(&record.key);
                tap.finish(stream::cut(problem.document()));
                // Kept for the operator when the record becomes `unknown`; within the bound only.
                p.partial = tap.body().map(|body| StoredResponse { status, headers: head.headers.clone(), body });
                attempt.error = Some(short.error());
                short.stop()
            }
        };
        self.streams.remove(record.id);
        span.in_scope(|| {
            tracing::info!(
                attempt = p.number,
                outcome = class.as_str(),
                status,
                first_byte_ms = first_byte.as_millis() as u64,
                took_ms = attempt.duration_ms,
                bytes = tap.received(),
                stop = stop.as_str(),
                "streamed attempt"
            )
        });
        metrics::attempt(&route.name, chosen.version, class, took);
        // The pace estimates when an outcome is due from how long answers take to start.
        route.observe(first_byte);
        let bytes = tap.received();
        let facts = StreamFacts {
            bytes,
            stored: tap.body().is_some(),
            cut_at: ended.is_err().then_some(bytes),
            first_byte_ms: first_byte.as_millis() as u64,
            duration_ms: took.as_millis() as u64,
        };
        metrics::streamed(&route.name, first_byte, took, bytes);
        p.stream = Some(facts);
        End::Stop(stop, Some(attempt))
    }
}
