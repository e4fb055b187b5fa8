use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The seed article's policy: 1500 ms budget, 600 ms per try, 100 ms minimum window,
/// base 200 ms, cap 800 ms, full jitter.
fn seed() -> RetryPolicy {
    RetryPolicy::seed_example()
}

fn after(attempts: u32, class: Class, elapsed: u64) -> AfterAttempt {
    AfterAttempt {
        attempts,
        class,
        retry_after: None,
        elapsed: ms(elapsed),
        previous_wait: None,
        cancelled: false,
        circuit_open: false,
        retries_off: false,
    }
}

fn no_draw() -> f64 {
    panic!("the policy drew a random number where it must not")
}

fn half() -> f64 {
    0.5
}

fn budget() -> Result<(), BudgetScope> {
    Ok(())
}

#[test]
fn classification_follows_the_route_lists() {
    let p = seed();
    assert_eq!(p.classify(Observed::Response(201)), Class::Success);
    assert_eq!(p.classify(Observed::Response(400)), Class::Final);
    assert_eq!(p.classify(Observed::Response(401)), Class::Final);
    assert_eq!(p.classify(Observed::Response(500)), Class::Final);
    assert_eq!(p.classify(Observed::Response(503)), Class::NotExecuted);
    assert_eq!(p.classify(Observed::Response(429)), Class::NotExecuted);
    assert_eq!(p.classify(Observed::Response(502)), Class::Ambiguous);
    assert_eq!(p.classify(Observed::Response(504)), Class::Ambiguous);
    assert_eq!(p.classify(Observed::ConnectFailed), Class::NotExecuted);
    assert_eq!(p.classify(Observed::TimedOut), Class::Ambiguous);
    assert_eq!(p.classify(Observed::Broken), Class::Ambiguous);
    let custom = RetryPolicy { not_processed: vec![], ambiguous: vec![503], ..seed() };
    assert_eq!(custom.classify(Observed::Response(503)), Class::Ambiguous);
    assert_eq!(custom.classify(Observed::Response(429)), Class::Final);
}

#[test]
fn a_401_stops_after_one_attempt_without_waiting() {
    let p = seed();
    let d = p.after_attempt(false, after(1, p.classify(Observed::Response(401)), 30), no_draw, || {
        panic!("budget consulted")
    });
    assert_eq!(d, Decision::Stop(StopReason::FinalResponse));
}

#[test]
fn an_ambiguous_503_on_an_unsafe_route_stops_as_unknown() {
    let p = RetryPolicy { not_processed: vec![429], ambiguous: vec![502, 503, 504], ..seed() };
    let class = p.classify(Observed::Response(503));
    assert_eq!(p.after_attempt(false, after(1, class, 100), no_draw, budget), Decision::Stop(StopReason::UnsafeReplay));
    // The same answer on a replay-safe route is retried.
    assert!(matches!(p.after_attempt(true, after(1, class, 100), half, budget), Decision::RetryAfter(_)));
}

#[test]
fn a_retry_after_is_a_floor_that_is_never_shortened() {
    let p = seed();
    let a = AfterAttempt { retry_after: Some(ms(300)), ..after(1, Class::NotExecuted, 400) };
    // Full jitter at 0.5 of a 200 ms ceiling is 100 ms; the server asked for 300 ms.
    assert_eq!(p.after_attempt(false, a, half, budget), Decision::RetryAfter(ms(300)));
    let a = AfterAttempt { retry_after: Some(ms(50)), ..a };
    assert_eq!(p.after_attempt(false, a, half, budget), Decision::RetryAfter(ms(100)));
}

#[test]
fn a_retry_after_beyond_the_remaining_budget_stops_without_sleeping_or_sending() {
    let p = seed();
    let a = AfterAttempt { retry_after: Some(ms(3000)), ..after(1, Class::NotExecuted, 1000) };
    let d = p.after_attempt(false, a, half, || panic!("budget taken for a retry that will not happen"));
    assert_eq!(d, Decision::Stop(StopReason::RetryAfterBeyondDeadline));
}

#[test]
fn success_arriving_exactly_at_the_deadline_is_a_deadline_stop() {
    let p = seed();
    let d = p.after_attempt(false, after(2, Class::Success, 1500), no_draw, budget);
    assert_eq!(d, Decision::Stop(StopReason::Deadline));
}

#[test]
fn a_cancel_stops_retrying() {
    let p = seed();
    let a = AfterAttempt { cancelled: true, ..after(1, Class::NotExecuted, 100) };
    assert_eq!(p.after_attempt(true, a, no_draw, budget), Decision::Stop(StopReason::Cancelled));
}

#[test]
fn a_single_attempt_policy_never_draws_or_waits() {
    let p = RetryPolicy { max_attempts: 1, ..seed() };
    let d = p.after_attempt(true, after(1, Class::NotExecuted, 10), no_draw, || panic!("budget"));
    assert_eq!(d, Decision::Stop(StopReason::AttemptCap));
}

#[test]
fn an_exhausted_budget_or_an_open_circuit_stops_retries() {
    let p = seed();
    let d = p.after_attempt(false, after(1, Class::NotExecuted, 10), half, || Err(BudgetScope::Route));
    assert_eq!(d, Decision::Stop(StopReason::RetryBudget));
    // A tenant's quota or an upstream's budget stops it with a reason of its own.
    let d = p.after_attempt(false, after(1, Class::NotExecuted, 10), half, || Err(BudgetScope::Tenant));
    assert_eq!(d, Decision::Stop(StopReason::TenantBudget));
    let d = p.after_attempt(false, after(1, Class::NotExecuted, 10), half, || Err(BudgetScope::Upstream));
    assert_eq!(d, Decision::Stop(StopReason::UpstreamBudget));
    let a = AfterAttempt { circuit_open: true, ..after(1, Class::NotExecuted, 10) };
    assert_eq!(p.after_attempt(false, a, no_draw, budget), Decision::Stop(StopReason::CircuitOpen));
}

#[test]
fn no_attempt_starts_with_less_than_min_try_left() {
    let p = seed();
    assert_eq!(p.attempt_limit(ms(0)), Ok(ms(600)));
    assert_eq!(p.attempt_limit(ms(1100)), Ok(ms(400)));
    assert_eq!(p.attempt_limit(ms(1400)), Ok(ms(100)));
    assert_eq!(p.attempt_limit(ms(1401)), Err(StopReason::Deadline));
    assert_eq!(p.attempt_limit(ms(9000)), Err(StopReason::Deadline));
}

#[test]
fn backoff_ceilings_double_up_to_the_cap() {
    let p = seed();
    assert_eq!(p.ceiling(1), ms(200));
    assert_eq!(p.ceiling(2), ms(400));
    assert_eq!(p.ceiling(3), ms(800));
    assert_eq!(p.ceiling(4), ms(800));
    assert_eq!(p.ceiling(80), ms(800));
}

#[test]
fn each_jitter_mode_stays_in_its_range() {
    let with = |jitter| RetryPolicy { jitter, ..seed() };
    let full = with(Jitter::Full);
    assert_eq!(full.jittered(2, None, 0.0), ms(0));
    assert_eq!(full.jittered(2, None, 1.0), ms(400));
    assert_eq!(full.jittered(2, None, 0.25), ms(100));
    let equal = with(Jitter::Equal);
    assert_eq!(equal.jittered(2, None, 0.0), ms(200));
    assert_eq!(equal.jittered(2, None, 1.0), ms(400));
    let none = with(Jitter::None);
    assert_eq!(none.jittered(3, None, 0.7), ms(800));
    let dec = with(Jitter::Decorrelated);
    assert_eq!(dec.jittered(1, None, 0.0), ms(200));
    assert_eq!(dec.jittered(1, None, 1.0), ms(600));
    assert_eq!(dec.jittered(2, Some(ms(600)), 1.0), ms(800), "capped");
    assert_eq!(dec.jittered(2, Some(ms(250)), 0.5), ms(475));
    // A broken random source cannot produce a wait outside the range.
    assert_eq!(full.jittered(1, None, f64::NAN), ms(0));
    assert_eq!(full.jittered(1, None, 7.0), ms(200));
}

/// The seed article's worked example: a 400 ms 503 with Retry-After 300 ms, a 300 ms wait,
/// then a 700 ms hang cut at the 600 ms per-try limit; at 1300 ms the next wait (200 ms)
/// would leave 0 ms < 100 ms, so it stops there, having sent two attempts.
#[test]
fn the_seed_worked_example_ends_at_1300_ms() {
    let p = seed();
    let mut elapsed = ms(0);

    let limit = p.attempt_limit(elapsed).unwrap();
    assert_eq!(limit, ms(600));
    elapsed += ms(400);
    let first =
        AfterAttempt { retry_after: Some(ms(300)), elapsed, ..after(1, p.classify(Observed::Response(503)), 0) };
    let Decision::RetryAfter(wait) = p.after_attempt(true, first, half, budget) else { panic!("expected a retry") };
    assert_eq!(wait, ms(300));
    elapsed += wait;

    let limit = p.attempt_limit(elapsed).unwrap();
    assert_eq!(limit, ms(600));
    elapsed += limit; // the 700 ms hang is cut at the limit; its late answer is never used
    let second = AfterAttempt { previous_wait: Some(wait), elapsed, ..after(2, p.classify(Observed::TimedOut), 0) };
    let d = p.after_attempt(true, second, half, budget);
    assert_eq!(d, Decision::Stop(StopReason::Deadline));
    assert_eq!(elapsed, ms(1300));
}

#[test]
fn retry_after_accepts_seconds_and_http_dates_and_ignores_garbage() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
    assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
    assert_eq!(parse_retry_after("\t3 ", now), Some(Duration::from_secs(3)));
    let later = httpdate::fmt_http_date(now + Duration::from_secs(120));
    assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(120)));
    let past = httpdate::fmt_http_date(now - Duration::from_secs(120));
    assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
    assert_eq!(parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", now), Some(Duration::ZERO));
    assert_eq!(parse_retry_after("99999999999999999999999", now), Some(MAX_RETRY_AFTER));
    let epoch = SystemTime::UNIX_EPOCH;
    assert_eq!(parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", epoch), Some(MAX_RETRY_AFTER));
    for garbage in ["", "-1", "+1", "1.5", "soon", "3s", "Mon, 99 Foo 2024 00:00:00 GMT", "\u{a0}3", "3\u{c}"] {
        assert_eq!(parse_retry_after(garbage, now), None, "{garbage:?}");
    }
}

#[test]
fn settlement_never_forgets_a_possible_execution() {
    use Settlement::*;
    assert_eq!(settle(StopReason::Success, Some(Class::Success), false, false), Done);
    assert_eq!(settle(StopReason::FinalResponse, Some(Class::Final), false, false), Done);
    assert_eq!(settle(StopReason::UnsafeReplay, Some(Class::Ambiguous), true, false), Unknown);
    // A success at the deadline executed: it is stored, not released.
    assert_eq!(settle(StopReason::Deadline, Some(Class::Success), false, false), Done);
    // A deadline or cancel after an ambiguous attempt on an unsafe route is unknown...
    assert_eq!(settle(StopReason::Deadline, Some(Class::Ambiguous), true, false), Unknown);
    assert_eq!(settle(StopReason::Cancelled, Some(Class::NotExecuted), true, false), Unknown);
    // ...and on a replay-safe route the key is released.
    assert_eq!(settle(StopReason::Deadline, Some(Class::Ambiguous), true, true), Free);
    for stop in
        [StopReason::AttemptCap, StopReason::RetryBudget, StopReason::RetryAfterBeyondDeadline, StopReason::CircuitOpen]
    {
        assert_eq!(settle(stop, Some(Class::NotExecuted), false, false), Free, "{stop:?}");
    }
    assert_eq!(settle(StopReason::Deadline, None, false, false), Free);
}

#[test]
fn stop_reasons_round_trip_through_their_names() {
    for r in StopReason::ALL {
        assert_eq!(StopReason::parse(r.as_str()), Some(r));
    }
    assert_eq!(StopReason::parse("bogus"), None);
}

#[test]
fn with_retries_off_a_retry_becomes_a_stop_and_takes_no_budget() {
    let p = seed();
    let a = AfterAttempt { retries_off: true, ..after(1, Class::NotExecuted, 300) };
    let d = p.after_attempt(true, a, || panic!("no wait is computed"), || panic!("no budget is taken"));
    assert_eq!(d, Decision::Stop(StopReason::RetriesOff));
    // The stops that come first keep their reasons.
    let capped = AfterAttempt { retries_off: true, ..after(3, Class::NotExecuted, 300) };
    assert_eq!(p.after_attempt(true, capped, half, budget), Decision::Stop(StopReason::AttemptCap));
}
