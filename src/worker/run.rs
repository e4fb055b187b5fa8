//! One execution: claim, attempts (each stored before it is sent and after it ends), waits
//! between them, and the settlement of the record.

use super::*;
use crate::switch::SwitchAction;

/// Counts a running execution for the shutdown drain.
pub(super) struct Running<'a>(&'a Inner);

impl<'a> Running<'a> {
    pub(super) fn new(inner: &'a Inner) -> Running<'a> {
        inner.active.fetch_add(1, Ordering::SeqCst);
        Running(inner)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Inner {
    /// See [`Worker::policy`].
    pub(super) fn policy<'r>(&self, route: &'r Route, tenant: &str, key: &str) -> Policy<'r> {
        route.policy_for(tenant, key, !self.switches.canary_off(&route.name))
    }

    /// The policy a record executes under: the one its attempts were marked with when it has
    /// any (so a canary switched off or on meanwhile moves no record across), else a fresh choice.
    fn policy_of<'r>(&self, route: &'r Route, record: &Record) -> Policy<'r> {
        let marked = record.policy_version.as_deref().and_then(|v| route.policy_named(v));
        marked.unwrap_or_else(|| self.policy(route, &record.tenant, &record.key))
    }

    pub(super) fn stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    pub(super) fn lease_until(&self, now: Millis) -> Millis {
        now + duration_ms(self.lease)
    }

    /// The write that stores how an attempt of `record` (or the execution) ended.
    fn ended(&self, record: &Record, attempt: Option<Attempt>, then: store::AfterAttempt, now: Millis) -> AttemptEnded {
        AttemptEnded { id: record.id.into(), owner: self.owner.clone(), attempt, then, now }
    }

    /// The write that extends this worker's lease on `id` from `now`.
    fn renewal(&self, id: Uuid, now: Millis) -> Renew {
        Renew { id: id.into(), owner: self.owner.clone(), lease_until: self.lease_until(now), now }
    }

    pub(super) async fn claim_and_run(&self, record: Record) -> Outcome {
        let now = now_ms();
        let claimed = self
            .store
            .claim(ClaimQueued {
                id: record.id.into(),
                owner: self.owner.clone(),
                lease_until: self.lease_until(now),
                now,
            })
            .await;
        lock(&self.mine).remove(&record.id);
        match claimed {
            Ok(true) => self.run(record, None).await,
            Ok(false) => Outcome::Lost,
            Err(e) => {
                warn!(error = %e, "could not claim a record; it stays queued");
                Outcome::Lost
            }
        }
    }

    /// Runs attempts until the policy stops, storing each attempt before and after it is sent.
    /// The route and its policy are read once, here, from the configuration the record was
    /// admitted under when it was admitted claimed, else from the one in force now: a reload
    /// during the execution changes neither, and a route removed since still lets it finish.
    pub(super) async fn run(&self, record: Record, reserved: Option<(OwnedSemaphorePermit, Arc<Config>)>) -> Outcome {
        let (reserved, config) = match reserved {
            Some((place, config)) => (Some(place), config),
            None => (None, self.config.current()),
        };
        let Some(route) = config.route_named(&record.route) else {
            warn!(route = %record.route, "the record's route is no longer configured");
            let progress = Progress::new(&record, Duration::ZERO);
            return self.finish(&record, false, None, StopReason::Cancelled, progress).await;
        };
        // Checked at ingress; only a route changed since then can make it fail here.
        let Ok(url) = route.upstream_url(&record.path, &record.query) else {
            warn!(route = %record.route, "the record's path would not reach the upstream as recorded; not sending it");
            let progress = Progress::new(&record, Duration::ZERO);
            return self.finish(&record, false, None, StopReason::Cancelled, progress).await;
        };
        let credential = lock(&self.credentials).take(record.id);
        let mut credentials = route.upstream_headers.clone();
        if route.forward_authorization {
            let Some(sent) = credential else {
                // Reached here, a record that is not replay-safe has had no attempt that may have
                // executed (a take-over makes those unknown), so settling frees it.
                warn!("the client's credential is not held by this process; not sending");
                let progress = Progress::new(&record, Duration::ZERO);
                return self
                    .finish(&record, route.replay_safe, None, StopReason::CredentialUnavailable, progress)
                    .await;
            };
            if let Some(credential) = sent {
                credentials.insert(http::header::AUTHORIZATION, credential);
            }
        }
        let signal = Arc::new(CancelSignal::default());
        lock(&self.cancels).insert(record.id, signal.clone());
        let outcome = self.attempts(&record, route, url, &credentials, &signal, reserved).await;
        lock(&self.cancels).remove(&record.id);
        outcome
    }

    pub(super) async fn attempts(
        &self,
        record: &Record,
        route: &Route,
        url: reqwest::Url,
        credentials: &http::HeaderMap,
        signal: &CancelSignal,
        reserved: Option<OwnedSemaphorePermit>,
    ) -> Outcome {
        let chosen = self.policy_of(route, record);
        let policy = chosen.retry;
        // The route's limits as they stood when the execution started: its attempts count
        // against them to the end, whatever a reload does to the route meanwhile.
        let guard = self.guards.route(route);
        let mut p = Progress::new(record, policy.deadline);
        // Taken over (or handed back) in the middle of a wait: the rest of it is still owed.
        if let Some(not_before) = record.not_before {
            if let Some(rest) = Some(not_before - now_ms()).filter(|&ms| ms > 0) {
                match self.wait(record.id, Duration::from_millis(rest as u64), signal).await {
                    WaitEnd::Elapsed => {}
                    WaitEnd::Cancelled => {
                        return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                    }
                    WaitEnd::Stopping => return self.release(record).await,
                    WaitEnd::Lost => return Outcome::Lost,
                }
            }
            // The next attempt follows the whole wait, wherever it was spent: it is recorded as
            // such, and feeds decorrelated jitter as it would have.
            if let Some(last) = record.attempts.last() {
                let ended = last.started_at + last.duration_ms as Millis;
                let wait = Duration::from_millis((not_before - ended).max(0) as u64);
                p.wait_before = wait;
                p.run.waited(wait);
            }
        }
        let mut reserved = reserved;
        loop {
            // `marked`: admitted already claimed, with this first attempt marked as about to be
            // sent in the same commit, so nothing more is written before sending it.
            let (started, in_flight, marked) = match reserved.take() {
                Some(place) => (record.in_flight.map_or_else(now_ms, |(_, at)| at), Some(place), true),
                None => {
                    // A place among the route's attempts in flight, held for this attempt only.
                    let place = self.renewing(record.id, guard.attempts.clone().acquire_owned()).await.ok();
                    (now_ms(), place, false)
                }
            };
            let cancelled = signal.raised.load(Ordering::SeqCst);
            let switched = self.switches.switched(&route.name);
            let limit = match p.run.next_attempt(policy, since(p.arrival, started), cancelled, switched) {
                Ok(limit) => limit,
                Err(stop) => return self.finish_after(record, route, None, stop, p).await,
            };
            if self.stopping() && !marked {
                return self.release(record).await;
            }
            let made = p.run.sending();
            p.number += 1;
            if !marked {
                match self
                    .store
                    .attempt_started(AttemptStarted {
                        id: record.id.into(),
                        owner: self.owner.clone(),
                        number: p.number,
                        started_at: started,
                        lease_until: self.lease_until(started),
                        policy_version: chosen.version.clone(),
                    })
                    .await
                {
                    Ok(Lease::Held { cancel_requested: false }) => {}
                    Ok(Lease::Held { cancel_requested: true }) => {
                        return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                    }
                    Ok(Lease::Lost) => return Outcome::Lost,
                    Err(e) => {
                        // Without a durable "may have been sent" mark the attempt must not go out.
                        warn!(error = %e, "could not record an attempt; not sending it");
                        return Outcome::Lost;
                    }
                }
            }
            if made == 1 {
                guard.first_attempt();
            }
            let mut told = credentials.clone();
            upstream::tell_deadline(&mut told, route.deadline_header.as_ref(), limit);
            let clock = Instant::now();
            let sent = self.upstream.send(
                &record.method,
                url.clone(),
                &record.request.headers,
                &told,
                record.request.body.clone(),
                limit,
            );
            let span = info_span!("attempt", number = p.number, wait_ms = p.wait_before.as_millis() as u64);
            let result = self.renewing(record.id, sent).instrument(span.clone()).await;
            let took = clock.elapsed();
            drop(in_flight);

            let (observed, answer) = match result {
                Ok(answer) => (Observed::Response(answer.response.status), Some(answer)),
                Err(observed) => (observed, None),
            };
            let retry_after = answer.as_ref().and_then(|a| a.retry_after.as_deref()).and_then(|value| {
                let parsed = policy::parse_retry_after(value, SystemTime::now());
                if parsed.is_none() {
                    warn!(value, "ignoring an unparseable Retry-After from the upstream");
                }
                parsed
            });
            let switched = self.switches.switched(&route.name);
            let (class, decision) = p.run.ended(
                policy,
                route.replay_safe,
                Ended {
                    observed,
                    retry_after,
                    elapsed: since(p.arrival, now_ms()),
                    cancelled: signal.raised.load(Ordering::SeqCst),
                    // An isolated route's upstream is as good as behind an open circuit.
                    circuit_open: switched.isolated || self.guards.circuit_open(&route.upstream),
                    retries_off: switched.retries_off,
                },
                rand::random::<f64>,
                || guard.take_retry(),
            );
            let attempt = Attempt {
                number: p.number,
                started_at: started,
                duration_ms: took.as_millis() as u64,
                outcome: class.into(),
                status: answer.as_ref().map(|a| a.response.status),
                error: match observed {
                    Observed::Response(_) => None,
                    Observed::ConnectFailed => Some("connect_failed".into()),
                    Observed::TimedOut => Some("timed_out".into()),
                    Observed::Broken => Some("broken".into()),
                },
                wait_ms: p.wait_before.as_millis() as u64,
                policy_version: Some(chosen.version.to_string()),
                retry_after_ms: retry_after.map(|ra| ra.as_millis().min(u64::MAX as u128) as u64),
            };
            span.in_scope(|| {
                tracing::info!(
                    attempt = p.number,
                    outcome = class.as_str(),
                    status = attempt.status,
                    took_ms = attempt.duration_ms,
                    wait_ms = attempt.wait_ms,
                    "attempt"
                )
            });
            metrics::attempt(&route.name, chosen.version, class, took);
            self.pace.observe(&route.name, took);
            p.last_response = answer.map(|a| a.response);

            let wait = match decision {
                Decision::Stop(stop) => return self.finish_after(record, route, Some(attempt), stop, p).await,
                Decision::RetryAfter(wait) => wait,
            };
            let now = now_ms();
            let then = store::AfterAttempt::Wait { not_before: now + duration_ms(wait) };
            match self.store.attempt_ended(self.ended(record, Some(attempt), then, now)).await {
                Ok(Lease::Held { cancel_requested: false }) => {}
                Ok(Lease::Held { cancel_requested: true }) => {
                    return self.finish_after(record, route, None, StopReason::Cancelled, p).await
                }
                Ok(Lease::Lost) => return Outcome::Lost,
                Err(e) => {
                    warn!(error = %e, "could not record an attempt's outcome");
                    return Outcome::Lost;
                }
            }
            match self.wait(record.id, wait, signal).await {
                WaitEnd::Elapsed => {}
                WaitEnd::Cancelled => return self.finish_after(record, route, None, StopReason::Cancelled, p).await,
                WaitEnd::Stopping => return self.release(record).await,
                WaitEnd::Lost => return Outcome::Lost,
            }
            p.run.waited(wait);
            p.wait_before = wait;
        }
    }

    /// Hands a record back to the queue at shutdown, between attempts, for another worker (or
    /// this node after its restart) to continue within the same deadline.
    pub(super) async fn release(&self, record: &Record) -> Outcome {
        match self.store.attempt_ended(self.ended(record, None, store::AfterAttempt::Release, now_ms())).await {
            Ok(_) => tracing::info!(record = %record.id, "handed back at shutdown"),
            Err(e) => warn!(error = %e, "could not hand a record back; its lease will expire"),
        }
        Outcome::Lost
    }

    pub(super) async fn finish_after(
        &self,
        record: &Record,
        route: &Route,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> Outcome {
        // The breaker hears the request's logical outcome, once: did the upstream serve it?
        if let (true, Some(class)) = (stop != StopReason::Cancelled, p.run.last()) {
            let served = matches!(class, Class::Success | Class::Final)
                && p.last_response.as_ref().is_some_and(|r| r.status < 500);
            self.guards.record_outcome(&route.upstream, served);
        }
        metrics::stopped(&route.name, stop, p.run.attempts(), since(p.arrival, now_ms()));
        match stop {
            StopReason::RetriesOff => metrics::held_by_switch(&route.name, SwitchAction::RetriesOff),
            StopReason::CircuitOpen if self.switches.isolated(&route.name) => {
                metrics::held_by_switch(&route.name, SwitchAction::Isolate)
            }
            _ => {}
        }
        self.finish(record, route.replay_safe, attempt, stop, p).await
    }

    pub(super) async fn finish(
        &self,
        record: &Record,
        replay_safe: bool,
        attempt: Option<Attempt>,
        stop: StopReason,
        p: Progress,
    ) -> Outcome {
        let (then, outcome) = match (p.run.settle(stop, replay_safe), p.last_response) {
            (Settlement::Done, Some(response)) => {
                (store::AfterAttempt::Done(stop, response.clone()), Outcome::Done(stop, response))
            }
            (Settlement::Free, last) => (store::AfterAttempt::Free(stop), Outcome::Free(stop, last)),
            // `Done` always comes with the response that made it so; should it ever not, the
            // safe reading of an execution we cannot show is "unknown".
            (Settlement::Unknown, _) | (Settlement::Done, None) => {
                (store::AfterAttempt::Unknown(stop), Outcome::Unknown(stop))
            }
        };
        let result = self.store.attempt_ended(self.ended(record, attempt, then, now_ms())).await;
        self.settled.settled(record.id);
        match result {
            Ok(Lease::Held { .. }) => {
                tracing::info!(stop = stop.as_str(), "settled");
                outcome
            }
            Ok(Lease::Lost) => Outcome::Lost,
            Err(e) => {
                warn!(error = %e, "could not store an outcome; the lease will expire and be taken over");
                Outcome::Lost
            }
        }
    }

    /// Awaits an attempt while keeping the lease alive.
    pub(super) async fn renewing<F: Future>(&self, id: Uuid, attempt: F) -> F::Output {
        tokio::pin!(attempt);
        let every = self.lease / 3;
        loop {
            tokio::select! {
                out = &mut attempt => return out,
                _ = tokio::time::sleep(every) => {
                    let now = now_ms();
                    if let Ok(Lease::Lost) = self.store.renew(self.renewal(id, now)).await {
                        warn!("lost the lease while an attempt was in flight");
                    }
                }
            }
        }
    }

    /// Sleeps before a retry, renewing the lease, and stops at once on a cancel.
    pub(super) async fn wait(&self, id: Uuid, total: Duration, signal: &CancelSignal) -> WaitEnd {
        let until = tokio::time::Instant::now() + total;
        let slice = self.lease / 3;
        let mut stopping = self.stopping.subscribe();
        loop {
            if *stopping.borrow_and_update() {
                return WaitEnd::Stopping;
            }
            let notified = signal.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if signal.raised.load(Ordering::SeqCst) {
                return WaitEnd::Cancelled;
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return WaitEnd::Elapsed;
            }
            tokio::select! {
                _ = tokio::time::sleep((until - now).min(slice)) => {}
                _ = &mut notified => return WaitEnd::Cancelled,
                _ = stopping.changed() => return WaitEnd::Stopping,
            }
            if tokio::time::Instant::now() < until {
                let now = now_ms();
                match self.store.renew(self.renewal(id, now)).await {
                    Ok(Lease::Held { cancel_requested: true }) => return WaitEnd::Cancelled,
                    Ok(Lease::Lost) => return WaitEnd::Lost,
                    _ => {}
                }
            }
        }
    }
}

fn since(arrival: Millis, now: Millis) -> Duration {
    Duration::from_millis((now - arrival).max(0) as u64)
}
