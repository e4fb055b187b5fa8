//! Broken variants of the protocol, each one rule taken away or put back as it once stood. The
//! check must fail on every one of them, with a counterexample: a model that cannot tell a
//! broken protocol from the real one proves nothing.

/// One broken rule.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mutant {
    /// Protocol 2: an ambiguous outcome (a gateway's 504) brought its record's bound down to its
    /// own time, though the service behind the gateway may still execute the request.
    AmbiguousCutsBound,
    /// Protocol 2: a probe's 404 was judged against the bound when it was written, not when the
    /// probe was asked.
    ProbeJudgedAtWrite,
    /// `[store] sync = "normal"` on PostgreSQL: a crash of the database server loses the commits
    /// not yet flushed, answers told included.
    NormalCommitsLost,
    /// Leases set and compared in each node's own clock rather than the store's.
    LeasesOnNodeClocks,
    /// A take-over guarded by the claim and the lease only, not by the attempt in flight it was
    /// decided on.
    TakeoverIgnoresInFlight,
    /// A probe's 404 frees a record whatever its bound.
    ProbeTrustedBeforeBound,
    /// An outcome the store could not take is written again without the claim's lease being
    /// renewed between tries.
    UnrecordedOutcomeNotRenewed,
    /// A record whose policy a reload removed is judged by its route's current `replay_safe`.
    PolicyFromCurrentRoute,
    /// A done record's retention judged by the admitting node's clock.
    RetentionOnNodeClocks,
    /// A node that has just started takes over at once, though it cannot know of an outage that
    /// left another node holding an answer it told but could not record.
    NoTakeoverHoldAtStart,
    /// A node that saw the store fail takes over as soon as it answers again.
    NoTakeoverHoldAfterOutage,
    /// A node of the previous protocol may still write after the store moved on (no trigger).
    OlderNodeUnguarded,
    /// The migration to protocol 3 leaves the bounds protocol 2 cut short as they are.
    MigrationKeepsCutBounds,
    /// A node frozen between its mark and its send sends whenever it thaws.
    SendWindowUnchecked,
}

impl Mutant {
    pub const ALL: [Mutant; 14] = [
        Mutant::AmbiguousCutsBound,
        Mutant::ProbeJudgedAtWrite,
        Mutant::NormalCommitsLost,
        Mutant::LeasesOnNodeClocks,
        Mutant::TakeoverIgnoresInFlight,
        Mutant::ProbeTrustedBeforeBound,
        Mutant::UnrecordedOutcomeNotRenewed,
        Mutant::PolicyFromCurrentRoute,
        Mutant::RetentionOnNodeClocks,
        Mutant::NoTakeoverHoldAtStart,
        Mutant::NoTakeoverHoldAfterOutage,
        Mutant::OlderNodeUnguarded,
        Mutant::MigrationKeepsCutBounds,
        Mutant::SendWindowUnchecked,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mutant::AmbiguousCutsBound => "ambiguous-cuts-bound",
            Mutant::ProbeJudgedAtWrite => "probe-judged-at-write",
            Mutant::NormalCommitsLost => "normal-commits-lost",
            Mutant::LeasesOnNodeClocks => "leases-on-node-clocks",
            Mutant::TakeoverIgnoresInFlight => "takeover-ignores-in-flight",
            Mutant::ProbeTrustedBeforeBound => "probe-trusted-before-bound",
            Mutant::UnrecordedOutcomeNotRenewed => "unrecorded-outcome-not-renewed",
            Mutant::PolicyFromCurrentRoute => "policy-from-current-route",
            Mutant::RetentionOnNodeClocks => "retention-on-node-clocks",
            Mutant::NoTakeoverHoldAtStart => "no-takeover-hold-at-start",
            Mutant::NoTakeoverHoldAfterOutage => "no-takeover-hold-after-outage",
            Mutant::OlderNodeUnguarded => "older-node-unguarded",
            Mutant::MigrationKeepsCutBounds => "migration-keeps-cut-bounds",
            Mutant::SendWindowUnchecked => "send-window-unchecked",
        }
    }

    pub fn parse(name: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == name)
    }

    /// The scenario that catches it first ([`crate::scenarios`]).
    pub fn scenario(self) -> &'static str {
        match self {
            Mutant::AmbiguousCutsBound
            | Mutant::ProbeJudgedAtWrite
            | Mutant::LeasesOnNodeClocks
            | Mutant::ProbeTrustedBeforeBound
            | Mutant::SendWindowUnchecked => "three-nodes",
            Mutant::TakeoverIgnoresInFlight => "clock-step",
            Mutant::NormalCommitsLost
            | Mutant::UnrecordedOutcomeNotRenewed
            | Mutant::NoTakeoverHoldAtStart
            | Mutant::NoTakeoverHoldAfterOutage => "store",
            Mutant::PolicyFromCurrentRoute | Mutant::RetentionOnNodeClocks => "reload-retention",
            Mutant::OlderNodeUnguarded | Mutant::MigrationKeepsCutBounds => "upgrade",
        }
    }

    /// What it breaks, in a line.
    pub fn describe(self) -> &'static str {
        match self {
            Mutant::AmbiguousCutsBound => "an ambiguous outcome brings the attempt's bound down to its own time",
            Mutant::ProbeJudgedAtWrite => "a probe's 404 is judged against the bound when written, not when asked",
            Mutant::NormalCommitsLost => "commits not yet flushed are lost when the database server crashes",
            Mutant::LeasesOnNodeClocks => "leases are set and compared in each node's own clock",
            Mutant::TakeoverIgnoresInFlight => "a take-over is not guarded by the attempt in flight it read",
            Mutant::ProbeTrustedBeforeBound => "a probe's 404 frees a record before its attempts' bound",
            Mutant::UnrecordedOutcomeNotRenewed => {
                "a claim is not renewed while its unrecorded outcome is written again"
            }
            Mutant::PolicyFromCurrentRoute => "a record whose policy a reload removed takes the route's replay_safe",
            Mutant::RetentionOnNodeClocks => "a done record's retention is judged by the admitting node's clock",
            Mutant::NoTakeoverHoldAtStart => "a node takes over as soon as it starts",
            Mutant::NoTakeoverHoldAfterOutage => "a node takes over as soon as the store answers again",
            Mutant::OlderNodeUnguarded => "a node of the previous protocol still writes, by its own rules",
            Mutant::MigrationKeepsCutBounds => "the migration leaves bounds protocol 2 cut short",
            Mutant::SendWindowUnchecked => "an attempt is sent however long after its mark",
        }
    }
}
