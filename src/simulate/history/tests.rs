use uuid::Uuid;

use super::*;
use crate::record::Attempt;

fn route(retry: &str) -> Route {
    let text = format!(
        "[[routes]]\nname = \"payments\"\npath_prefix = \"/p\"\nupstream = \"http://127.0.0.1:9\"\n\
         replay_safe = true\n[routes.retry]\ndeadline = \"10s\"\nper_try_timeout = \"1s\"\nbase = \"100ms\"\n\
         cap = \"100ms\"\njitter = \"none\"\n{retry}"
    );
    Config::parse(&text).unwrap().routes[0].clone()
}

fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn attempt(number: u32, started_at: i64, status: u16) -> Attempt {
    Attempt {
        number,
        started_at: at(started_at),
        duration_ms: 10,
        outcome: crate::domain::AttemptOutcome::Success,
        status: Some(status),
        error: None,
        wait_ms: 0,
        retry_after_ms: None,
        policy_version: None,
        unreachable: None,
        detail: None,
    }
}

/// A request that arrived at `at` and met `statuses`, one attempt after another, 100 ms apart.
fn recorded(arrival: i64, statuses: &[u16], stop: StopReason) -> Recorded {
    Recorded {
        id: Uuid::new_v4(),
        tenant: "default".into(),
        created_at: at(arrival),
        deadline_at: at(arrival + 10_000),
        state: State::Done,
        stop_reason: Some(stop),
        attempts: statuses
            .iter()
            .enumerate()
            .map(|(i, &s)| attempt(i as u32 + 1, arrival + 110 * i as i64, s))
            .collect(),
        in_flight: false,
        tombstone: false,
        requeued_at: vec![],
    }
}

fn source() -> Source {
    Source { since: Since { at: at(0), text: "24h".into() }, cut: false, candidate_file: "candidate.toml".into() }
}

fn run(route: &Route, candidate: &str, history: Vec<Recorded>, assume: Assume) -> Comparison {
    let quotas = TenantQuotas::default();
    let candidate = Candidate::parse(candidate, route, &quotas).unwrap();
    compare(route, &quotas, &candidate, history, source(), &"0.5".parse().unwrap(), assume)
}

fn mixed() -> Vec<Recorded> {
    vec![
        recorded(1_000, &[200], StopReason::Success),
        recorded(2_000, &[503, 200], StopReason::Success),
        recorded(3_000, &[503, 503, 503], StopReason::AttemptCap),
    ]
}

#[test]
fn the_current_policy_replays_what_was_recorded() {
    let c = run(&route(""), "[retry]\nmax_attempts = 3\n", mixed(), Assume::Last);
    assert_eq!(c.recorded.requests, 3);
    assert_eq!(c.current.figures.attempts, 6);
    assert_eq!(c.current.figures, c.recorded);
    assert_eq!(c.current.unobserved, Unobserved::default());
}

#[test]
fn a_key_freed_and_sent_again_is_two_requests_not_a_salvage() {
    // One attempt answered 503 freed the key; its client sent it again 4 s later and got a 200.
    let mut record = recorded(1_000, &[503], StopReason::Success);
    record.attempts.push(attempt(2, 5_010, 200));
    record.requeued_at = vec![at(5_000)];
    record.deadline_at = at(5_000 + 10_000);
    let c = run(&route("max_attempts = 1"), "[retry]\nmax_attempts = 2\n", vec![record], Assume::Last);
    assert_eq!((c.recorded.requests, c.recorded.attempts, c.recorded.succeeded), (2, 2, 1));
    assert_eq!(c.recorded.salvaged, 0, "the client's own retry is not the policy's salvage");
    let f = &c.current.figures;
    assert_eq!((f.requests, f.attempts, f.succeeded, f.salvaged), (2, 2, 1, 0));
    assert_eq!(c.current.unobserved, Unobserved::default());
    assert!(c.recorded.p99.unwrap() < std::time::Duration::from_secs(1), "the client's 4 s gap is no request's time");
}

#[test]
fn a_single_attempt_candidate_salvages_nothing() {
    let c = run(&route(""), "[retry]\nmax_attempts = 1\n", mixed(), Assume::Last);
    let f = &c.candidate.figures;
    assert_eq!((f.requests, f.attempts, f.amplification()), (3, 3, Some(1.0)));
    assert_eq!((f.first_try, f.succeeded, f.salvaged), (1, 1, 0));
    assert_eq!(f.stops["attempt_cap"], 2);
}

#[test]
fn attempts_beyond_the_record_follow_the_assumption() {
    let last = run(&route(""), "[retry]\nmax_attempts = 5\n", mixed(), Assume::Last);
    // Only the request that ran out of attempts gets more: two more 503s.
    assert_eq!(last.candidate.unobserved, Unobserved { beyond: 2, ..Unobserved::default() });
    assert_eq!((last.candidate.figures.attempts, last.candidate.figures.succeeded), (8, 2));
    let hopeful = run(&route(""), "[retry]\nmax_attempts = 5\n", mixed(), Assume::Success);
    assert_eq!(hopeful.candidate.unobserved.beyond, 1);
    assert_eq!((hopeful.candidate.figures.succeeded, hopeful.candidate.figures.salvaged), (3, 2));
}

#[test]
fn the_retry_budget_is_shared_by_the_requests_in_time_order() {
    // Ten requests in the same second, each failing first: 10% of ten first attempts is one
    // retry. A budget per request would allow none; one shared allows exactly one.
    let route = route("budget_ratio = 0.1\nbudget_min_per_sec = 0.0\n");
    let history = (0..10).map(|i| recorded(1_000 + i, &[503, 200], StopReason::Success)).collect();
    let c = run(&route, "[retry]\nmax_attempts = 2\n", history, Assume::Last);
    assert_eq!((c.current.figures.salvaged, c.current.figures.budget_stopped), (1, 9));
}

#[test]
fn requests_not_ended_never_sent_or_past_retention_are_left_out() {
    let running = Recorded { stop_reason: None, state: State::InProgress, ..recorded(1, &[503], StopReason::Success) };
    let never_sent = recorded(2, &[], StopReason::Cancelled);
    let tombstone = Recorded { tombstone: true, attempts: vec![], ..recorded(3, &[], StopReason::Success) };
    let c = run(&route(""), "[retry]\nmax_attempts = 1\n", vec![running, never_sent, tombstone], Assume::Last);
    assert_eq!(c.left_out, LeftOut { running: 1, never_sent: 1, past_retention: 1 });
    assert_eq!(c.recorded.requests, 0);
    assert!(report::human(&c).contains("0 replayed"));
}

#[test]
fn a_deadline_the_client_shortened_holds_under_either_policy() {
    let mut r = recorded(0, &[503, 503], StopReason::Deadline);
    r.deadline_at = at(150);
    let c = run(&route(""), "[retry]\nmax_attempts = 3\ndeadline = \"60s\"\n", vec![r], Assume::Last);
    assert_eq!(c.candidate.figures.deadline_stopped, 1);
    assert_eq!(c.candidate.figures.attempts, 1);
}

#[test]
fn since_is_a_duration_back_or_a_time() {
    let now = at(100_000_000);
    assert_eq!(Since::parse("24h", at(100_000_000_000)).unwrap().at, at(100_000_000_000 - 86_400_000));
    assert_eq!(Since::parse("1970-01-01T00:01:00Z", now).unwrap().at, at(60_000));
    for bad in ["yesterday", "", "-5m", "24", "2999-01-01T00:00:00Z"] {
        assert!(Since::parse(bad, now).is_err(), "{bad:?}");
    }
}
