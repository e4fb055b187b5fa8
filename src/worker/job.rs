//! What an execution runs with, fixed when it starts: handed to each of its attempts.

use super::lease::{LeaseOf, LeaseTrust};
use super::running::CancelSignal;
use super::Reply;
use crate::config::Policy;
use crate::domain::Holder;
use crate::record::Record;
use crate::runtime::{Charges, ServedRoute};

/// What an execution runs with, fixed when it starts.
pub(super) struct Job<'a> {
    pub(super) record: &'a Record,
    /// The claim it runs under: every write it makes names it, and is refused once the record
    /// has been claimed again.
    pub(super) holder: &'a Holder,
    /// The route as the execution read it, with its runtime: a reload meanwhile changes nothing
    /// here, and its attempts count against the limits they started under to the end.
    pub(super) route: &'a ServedRoute,
    /// The policy its attempts run under, and are stored with.
    pub(super) chosen: Policy<'a>,
    pub(super) url: url::Url,
    /// The headers every attempt adds: the route's own, and the client's credential if forwarded.
    pub(super) credentials: &'a http::HeaderMap,
    pub(super) signal: &'a CancelSignal,
    /// How far this process trusts the claim's lease.
    pub(super) trust: &'a LeaseTrust,
    /// The retry budgets its attempts are charged to: its route's, its upstream's, its tenant's.
    pub(super) charges: Charges,
    /// The request waiting for the outcome, if any: told early when the answer streams.
    pub(super) reply: &'a Reply,
}

impl Job<'_> {
    /// Its claim's lease, as it is renewed beside an attempt.
    pub(super) fn lease(&self) -> LeaseOf<'_> {
        LeaseOf { id: self.record.id, holder: self.holder, route: &self.route.name, trust: self.trust }
    }
}
