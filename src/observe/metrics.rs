//! Metrics, in the Prometheus text format on the admin listener's `/metrics`. They keep the
//! *logical* request (what a client asked for) apart from the *physical* attempt (what reached
//! the upstream), so that amplification — attempts / requests — can be graphed and alerted on
//! before users see failures.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrics::{counter, describe_gauge, describe_histogram, gauge, histogram, Counter, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::domain::switch::SwitchAction;
use crate::domain::AnswerKind;
use crate::domain::Phase;
use crate::domain::{Class, PolicyVersion, RouteName, StopReason, Tenant};
use crate::policy::{BreakerState, CanarySide, Cohort};

/// How often histogram samples are folded into their buckets when nobody scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The process-wide recorder; the first broker started in a process installs it.
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
        // A commit takes a disk flush: a tenth of a millisecond to tens of them.
        let commit = [0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0];
        let writes = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
        // A stage of a new key: tens of microseconds (its reading) to the upstream's slowest.
        let stages = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1.0, 5.0, 30.0, 60.0];
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &buckets)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full("idem_store_commit_seconds".into()), &commit))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(STAGE_SECONDS.into()), &stages))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full("idem_store_commit_writes".into()), &writes))
            .expect("the bucket lists are not empty")
            .build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (an embedding application's): then ours
        // still renders, it just sees nothing recorded through the global macros.
        if metrics::set_global_recorder(recorder).is_ok() {
            describe();
            build_info();
            process().describe();
        }
        handle
    })
}

/// Histogram samples pile up in the recorder until drained, which a scrape does; with nobody
/// scraping they would grow without bound. This drains them every few seconds anyway, until
/// `turns` end.
pub(crate) async fn upkeep(mut turns: crate::domain::clock::Turns) {
    let mut tick = tokio::time::interval(UPKEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while turns.next(tick.tick()).await.is_some() {
        handle().run_upkeep();
    }
}

/// The process's own figures, as every Prometheus client library exports them and every
/// dashboard expects: `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
/// `process_start_time_seconds`, `process_threads`. Read at each scrape.
fn process() -> &'static metrics_process::Collector {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// The version this binary is, and the commit it was built from (`unknown` when it was not
/// built from a git checkout): always 1, for dashboards to join on and to see a rollout.
pub(crate) const VERSION: &str = env!("CARGO_PKG_VERSION");
pub(crate) const COMMIT: &str = env!("IDEM_COMMIT");

fn build_info() {
    describe_gauge!(
        "idem_build_info",
        "Always 1: the version of Idem this process runs, and the commit it was built from."
    );
    gauge!("idem_build_info", "version" => VERSION, "commit" => COMMIT).set(1.0);
}

/// HELP text for every family, so `/metrics` explains itself (and passes `promtool check metrics`).
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    for (name, help) in COUNTERS {
        describe_counter!(*name, *help);
    }
    for (name, help) in GAUGES {
        describe_gauge!(*name, *help);
    }
    for (name, help) in HISTOGRAMS_IN_SECONDS {
        describe_histogram!(*name, Unit::Seconds, *help);
    }
    describe_gauge!(
        "idem_config_loaded_at_seconds",
        Unit::Seconds,
        "When the configuration in force was loaded, in seconds since the Unix epoch."
    );
}

/// Each counter family and its HELP text.
const COUNTERS: &[(&str, &str)] = &[
    ("idem_requests_total", "Logical requests: new executions admitted, per route."),
    ("idem_attempts_total", "Physical attempts sent upstream, per route, outcome class and policy_version."),
    ("idem_config_reloads_total", "Configuration reloads (SIGHUP or POST /admin/config/reload), by result: applied or refused."),
    ("idem_stops_total", "Executions that ended, per route and stop reason."),
    ("idem_stream_bytes_total", "Streamed answers: body bytes passed through, per route."),
    ("idem_success_total", "Executions that ended with a success."),
    ("idem_first_try_success_total", "Executions that succeeded on their first attempt."),
    ("idem_retry_salvaged_total", "Executions that succeeded only after a retry."),
    ("idem_retry_budget_exhausted_total", "Executions stopped because the retry budget was spent."),
    ("idem_answers_total", "Answers given without executing, per route and kind (replay, in_progress, key_reused, ...)."),
    ("idem_unkeyed_requests_total", "Requests on a keyed method without a key, proxied unrecorded (routes with require_key = false)."),
    ("idem_connections_refused_total", "Connections past the listener's max_connections while every connection was busy with a request, answered 503 and closed."),
    ("idem_connections_reclaimed_total", "Idle connections (between keep-alive requests, or still waiting for a first head) closed to make room for new ones, per listener."),
    ("idem_outcomes_unrecorded_total", "Executions whose outcome the store could not take when the upstream answered, per route: the \
         client was told the outcome, and it is written again until the store takes it."),
    ("idem_lease_renewals_failed_total", "Lease renewals made while an attempt was in flight that failed (why=error) or found the claim taken \
         (why=lost), per route: the attempt finished, and no other started under that claim."),
    ("idem_access_lines_dropped_total", "Access log lines dropped because the log's destination was 8 MiB behind: the access \
         log gives way rather than hold up the requests it is about (other lines wait)."),
    ("idem_switch_held_total", "Attempts not started because an operator's emergency switch was on, per route and action: retries \
         stopped by retries_off, and new keys refused or executions stopped by isolate."),
];

/// Each gauge family counted in plain numbers, and its HELP text.
const GAUGES: &[(&str, &str)] = &[
    ("idem_records", "Records in the store by phase; phase=\"unknown\" is the reconciliation queue."),
    ("idem_circuit_state", "Each upstream's circuit: 0 closed, 1 half-open, 2 open."),
    ("idem_connections", "Open client connections, per listener (data, admin)."),
    ("idem_waiting_requests", "Requests waiting for a record to settle (Prefer: wait), per route."),
    ("idem_canary_running", "1 while a route's canary runs, 0 once a canary_off switch ended it."),
    ("idem_canary_requests", "Settled requests on each side of a canary (canary, control) in its window."),
    ("idem_canary_amplification", "Attempts per settled request on each side of a canary."),
    ("idem_canary_final_success", "Share of settled requests that succeeded, on each side of a canary."),
    ("idem_unrecorded_outcomes", "Outcomes the store could not take, still being written again: executed requests whose record does not show it yet."),
];

/// Each histogram family, all of them in seconds, and its HELP text.
const HISTOGRAMS_IN_SECONDS: &[(&str, &str)] = &[
    ("idem_attempt_duration_seconds", "Duration of one upstream attempt, per route, outcome class and policy_version."),
    ("idem_stream_first_byte_seconds", "Streamed answers: from the attempt's send to the first body byte, per route."),
    ("idem_stream_duration_seconds", "Streamed answers: from the attempt's send to the stream's end, per route."),
    ("idem_request_duration_seconds", "End-to-end time of an execution, from the request's arrival to its outcome."),
];

/// Whether a route's canary runs (1) or was ended by a `canary_off` switch (0).
pub(crate) fn canary_running(route: &RouteName, version: &PolicyVersion, running: bool) {
    let (route, version) = (route.to_string(), version.to_string());
    gauge!("idem_canary_running", "route" => route, "policy_version" => version).set(f64::from(u8::from(running)));
}

/// One side of a canary (`canary`, or `control`: the route's own policy) as the store last
/// counted it, cluster-wide: settled requests, attempts per request, final success.
pub(crate) fn canary_side(route: &RouteName, side: CanarySide, version: &PolicyVersion, cohort: Cohort) {
    let labels =
        [("route", route.to_string()), ("side", side.as_str().to_string()), ("policy_version", version.to_string())];
    gauge!("idem_canary_requests", &labels).set(cohort.requests as f64);
    gauge!("idem_canary_amplification", &labels).set(cohort.amplification());
    gauge!("idem_canary_final_success", &labels).set(cohort.final_success());
}

/// One physical attempt, how it was classified, and the version of the policy it was sent under:
/// two policies of one route, before and after a reload, are told apart on every graph.
pub(crate) fn attempt(route: &RouteName, version: &PolicyVersion, class: Class, took: Duration) {
    let (route, class, version) = (route.to_string(), class.as_str(), version.to_string());
    counter!("idem_attempts_total", "route" => route.clone(), "class" => class, "policy_version" => version.clone())
        .increment(1);
    histogram!("idem_attempt_duration_seconds", "route" => route, "class" => class, "policy_version" => version)
        .record(took.as_secs_f64());
}

/// A reload was applied or refused.
pub(crate) fn config_reload(applied: bool) {
    let result = if applied { "applied" } else { "refused" };
    counter!("idem_config_reloads_total", "result" => result).increment(1);
}

/// The configuration in force was loaded at `at`.
pub(crate) fn config_loaded(at: std::time::SystemTime) {
    let seconds = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
    gauge!("idem_config_loaded_at_seconds").set(seconds);
}

/// An execution stopped. `attempts` it took; `took` from the request's arrival.
pub(crate) fn stopped(route: &RouteName, tenant: &Tenant, stop: StopReason, attempts: u32, took: Duration) {
    let route = route.to_string();
    counter!("idem_stops_total", "route" => route.clone(), "reason" => stop.as_str()).increment(1);
    histogram!("idem_request_duration_seconds", "route" => route.clone()).record(took.as_secs_f64());
    if stop == StopReason::Success {
        counter!("idem_success_total", "route" => route.clone()).increment(1);
        if attempts == 1 {
            counter!("idem_first_try_success_total", "route" => route).increment(1);
        } else {
            counter!("idem_retry_salvaged_total", "route" => route).increment(1);
        }
    } else if let Some(scope) = stop.budget() {
        let labels = [("route", route), ("tenant", tenant.to_string()), ("scope", scope.as_str().to_string())];
        counter!("idem_retry_budget_exhausted_total", &labels).increment(1);
    }
}

/// A streamed answer ended (docs/concepts.md): its time to first byte, its duration and its bytes.
pub(crate) fn streamed(route: &RouteName, first_byte: Duration, took: Duration, bytes: u64) {
    let route = route.to_string();
    histogram!("idem_stream_first_byte_seconds", "route" => route.clone()).record(first_byte.as_secs_f64());
    histogram!("idem_stream_duration_seconds", "route" => route.clone()).record(took.as_secs_f64());
    counter!("idem_stream_bytes_total", "route" => route).increment(bytes);
}

/// A take-over stopped a record whose worker died (docs/concepts.md): `unsafe_replay`, `deadline` or
/// `takeover_cap`. Counted with the stops of executions, which it ended.
pub(crate) fn stopped_by_take_over(route: &RouteName, stop: StopReason) {
    counter!("idem_stops_total", "route" => route.to_string(), "reason" => stop.as_str()).increment(1);
}

/// A request waits for a record of `route` to settle (`Prefer: wait`), until the guard is
/// dropped: parked clients hold connections, which operators see before they run out.
pub(crate) fn waiting(route: &RouteName) -> Waiting {
    let gauge = gauge!("idem_waiting_requests", "route" => route.to_string());
    gauge.increment(1.0);
    Waiting(gauge)
}

pub(crate) struct Waiting(metrics::Gauge);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// An answer the ingress gave without executing: `replay`, `in_progress` (409), `key_reused`
/// (422), `unknown` (502), `overloaded`, `buffers_full` (the body budget is spent) or
/// `circuit_open` (503, shed before recording).
/// The counters a route's every request may touch, registered once when its runtime is built
/// (at start and at each reload) rather than looked up by their labels per request.
pub(crate) struct RouteCounters {
    requests: Counter,
    replays: Counter,
}

impl RouteCounters {
    pub(crate) fn new(route: &RouteName) -> RouteCounters {
        RouteCounters {
            requests: counter!("idem_requests_total", "route" => route.to_string()),
            replays: counter!("idem_answers_total", "route" => route.to_string(), "kind" => AnswerKind::Replay.as_str()),
        }
    }

    /// A new execution admitted (`idem_requests_total`).
    pub(crate) fn request(&self) {
        self.requests.increment(1);
    }

    /// A done answer replayed (`idem_answers_total{kind="replay"}`).
    pub(crate) fn replay(&self) {
        self.replays.increment(1);
    }
}

pub(crate) fn answered(route: &RouteName, kind: AnswerKind) {
    counter!("idem_answers_total", "route" => route.to_string(), "kind" => kind.as_str()).increment(1);
}

/// The emergency switch `action`, on for `route`, held something back: a request refused, or an
/// attempt not started.
pub(crate) fn held_by_switch(route: &RouteName, action: SwitchAction) {
    counter!("idem_switch_held_total", "route" => route.to_string(), "action" => action.as_str()).increment(1);
}

/// A request on a keyed method came without a key, on a route that does not require one: it
/// was proxied unrecorded.
pub(crate) fn unkeyed(route: &RouteName) {
    counter!("idem_unkeyed_requests_total", "route" => route.to_string()).increment(1);
}

/// A client connection was accepted on `listener` (`data` or `admin`).
pub(crate) fn connection_opened(listener: &'static str) {
    gauge!("idem_connections", "listener" => listener).increment(1.0);
}

pub(crate) fn connection_closed(listener: &'static str) {
    gauge!("idem_connections", "listener" => listener).decrement(1.0);
}

/// A connection past the listener's budget was answered 503 and closed.
/// Idle connections closed to make room for new ones in a full table.
pub(crate) fn connections_reclaimed(listener: &'static str, n: usize) {
    counter!("idem_connections_reclaimed_total", "listener" => listener).increment(n as u64);
}

pub(crate) fn connection_refused(listener: &'static str) {
    counter!("idem_connections_refused_total", "listener" => listener).increment(1);
}

/// An execution's outcome the store could not take when it came.
pub(crate) fn outcome_unrecorded(route: &RouteName) {
    counter!("idem_outcomes_unrecorded_total", "route" => route.to_string()).increment(1);
}

/// A lease renewal made while an attempt was in flight failed (`error`) or found the claim
/// taken (`lost`).
pub(crate) fn renewal_failed(route: &RouteName, why: &'static str) {
    counter!("idem_lease_renewals_failed_total", "route" => route.to_string(), "why" => why).increment(1);
}

/// One more outcome the store could not take is being written again (`true`), or one less.
pub(crate) fn unrecorded_outcome_waits(more: bool) {
    match more {
        true => gauge!("idem_unrecorded_outcomes").increment(1.0),
        false => gauge!("idem_unrecorded_outcomes").decrement(1.0),
    }
}

/// Whether the store takes requests: 1, or 0 while new keys are refused with 503
/// `store-unavailable` (a lost SQLite file, an unreachable database).
pub(crate) fn store_available(available: bool) {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        describe_gauge!(
            "idem_store_available",
            "1 while the store takes requests; 0 while new keys are refused with 503 store-unavailable"
        )
    });
    gauge!("idem_store_available").set(if available { 1.0 } else { 0.0 });
}

/// One commit of the SQLite store's writer: how long it took (its statements and the log's
/// flush to disk) and how many writes it carried. Under load many writes share one commit; the
/// two together say whether new keys wait on the disk or on the rest. Writes refused while the
/// store is lost are not commits.
pub(crate) fn store_commit(took: Duration, writes: usize) {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        describe_histogram!(
            "idem_store_commit_seconds",
            Unit::Seconds,
            "SQLite store: duration of one commit of the writer, its flush to disk included."
        );
        describe_histogram!("idem_store_commit_writes", "SQLite store: writes carried by one commit (group commit).");
    });
    histogram!("idem_store_commit_seconds").record(took.as_secs_f64());
    histogram!("idem_store_commit_writes").record(writes as f64);
}

/// The histogram of [`Stage`]s.
const STAGE_SECONDS: &str = "idem_new_key_stage_seconds";

/// A stage of a new key's way through the broker, from its arrival to its answer. Counted for a
/// request whose execution went out at once (without waiting for a worker), whose client waited
/// for the outcome and was answered, and whose answer was read whole (not streamed) by an
/// attempt that was sent.
/// The stages follow each other, and `answered` is the whole way: what it has over their sum is
/// the outcome handed back to the request and the answer built from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// From the request's arrival to its record handed to the store: head, body, key, fingerprint.
    Read,
    /// Until the record is durable: the writer's queue and the commit.
    AdmissionCommit,
    /// From the durable record to the attempt handed to the upstream client.
    ToSend,
    /// Until the upstream's last answer is read: every attempt, and between them the waits and
    /// the writes that store each attempt's end and the next one's start.
    Upstream,
    /// From the upstream's answer to the outcome handed to the store.
    ToOutcome,
    /// Until the outcome is durable: the writer's queue and the commit.
    OutcomeCommit,
    /// The whole way, from the arrival to the answer built from the outcome.
    Answered,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Read => "read",
            Stage::AdmissionCommit => "admission_commit",
            Stage::ToSend => "to_send",
            Stage::Upstream => "upstream",
            Stage::ToOutcome => "to_outcome",
            Stage::OutcomeCommit => "outcome_commit",
            Stage::Answered => "answered",
        }
    }
}

/// A new key spent `took` in `stage`.
pub(crate) fn stage(stage: Stage, took: Duration) {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        describe_histogram!(
            STAGE_SECONDS,
            Unit::Seconds,
            "A new key executed at once, stage by stage from its arrival to its answer (answered is the whole way)."
        )
    });
    histogram!(STAGE_SECONDS, "stage" => stage.as_str()).record(took.as_secs_f64());
}

/// A stopwatch over the consecutive [`Stage`]s before `answered`: each lap ends one where the
/// last one ended. Its laps are recorded together with the whole way, once the answer is built
/// and only if every lap was taken, so that every stage counts the same requests.
#[derive(Debug)]
pub struct Laps {
    arrived: Instant,
    last: Instant,
    took: [Option<Duration>; 6],
}

impl Laps {
    pub fn starting(arrived: Instant) -> Laps {
        Laps { arrived, last: arrived, took: [None; 6] }
    }

    /// Ends `stage` now.
    pub fn lap(&mut self, stage: Stage) {
        self.lap_at(stage, Instant::now());
    }

    /// Ends `stage` at `at`.
    pub fn lap_at(&mut self, stage: Stage, at: Instant) {
        if let Some(i) = STAGES.iter().position(|s| *s == stage) {
            self.took[i] = Some(at.saturating_duration_since(self.last));
        }
        self.last = at;
    }

    /// The answer is built: records every stage and the whole way (`answered`, from the
    /// arrival to now), if every stage was lapped; otherwise nothing.
    pub fn answered(self) {
        if self.took.iter().all(Option::is_some) {
            for (stage, took) in STAGES.iter().zip(self.took.iter().flatten()) {
                self::stage(*stage, *took);
            }
            self::stage(Stage::Answered, self.arrived.elapsed());
        }
    }
}

/// The stages a [`Laps`] takes, in their order.
const STAGES: [Stage; 6] =
    [Stage::Read, Stage::AdmissionCommit, Stage::ToSend, Stage::Upstream, Stage::ToOutcome, Stage::OutcomeCommit];

/// Renders every series, with the store's records by phase (the reconciliation queue depth is
/// `idem_records{phase="unknown"}`), each upstream's circuit, the request body bytes held in
/// memory and the emergency switches' family (already written), read at scrape time. Without `phases` (the store could not count them), the records
/// keep the last counts seen: zero would say the reconciliation queue is empty.
pub(crate) fn render(
    phases: Option<&[(Phase, u64)]>,
    circuits: &[(String, BreakerState)],
    buffered_body_bytes: usize,
    switches: &str,
) -> String {
    for phase in [Phase::Queued, Phase::Free, Phase::InProgress, Phase::Done, Phase::Unknown] {
        if let Some(phases) = phases {
            let n = phases.iter().filter(|(p, _)| *p == phase).map(|(_, n)| *n).sum::<u64>();
            gauge!("idem_records", "phase" => phase.as_str()).set(n as f64);
        }
    }
    for (upstream, state) in circuits {
        let value = match state {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        };
        gauge!("idem_circuit_state", "upstream" => upstream.clone()).set(value);
    }
    process().collect();
    counter!("idem_access_lines_dropped_total").absolute(crate::observe::logs::access_lines_dropped());
    // Written here rather than through the process-wide recorder: it is this broker's own
    // figure, even when one process runs several brokers.
    let mut text = handle().render();
    text.push_str("# HELP idem_buffered_body_bytes Request body bytes held in memory by the data plane.\n");
    text.push_str("# TYPE idem_buffered_body_bytes gauge\n");
    text.push_str(&format!("idem_buffered_body_bytes {buffered_body_bytes}\n"));
    text.push_str(switches);
    text
}
