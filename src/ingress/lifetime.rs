//! How long a key's answer lives (docs/agents.md): replayed until its route's retention ends, then
//! remembered by a tombstone that refuses the same request instead of executing it again.

use std::time::Duration;

use super::Ingress;
use crate::domain::{State, Timestamp};
use crate::problem::Problem;
use crate::record::Record;

impl Ingress {
    /// How long a route's done records are replayed, as configured now; a route no longer
    /// configured keeps the store's.
    pub(super) fn retention(&self, route: &str) -> Duration {
        let config = self.config.current();
        config.route_named(route).map_or(config.store.retention, |r| r.retention)
    }

    pub(super) fn retention_cutoff(&self, route: &str) -> Timestamp {
        self.clock.now() - self.retention(route)
    }

    /// A done record whose answer is no longer kept: a tombstone, or past its retention and not
    /// yet swept. The same request is refused, never executed again (docs/agents.md).
    pub(super) fn spent(&self, record: &Record) -> Option<Problem> {
        let spent = record.state == State::Done && (record.tombstone_until.is_some() || self.expired(record));
        let status = record.response.as_ref().map(|r| r.status);
        spent.then(|| Problem::result_expired(status, &record.updated_at.rfc3339()).state(State::Done))
    }

    pub(super) fn expired(&self, record: &Record) -> bool {
        record.state == State::Done && record.updated_at < self.retention_cutoff(&record.route)
    }
}
