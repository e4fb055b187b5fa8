//! The record reader: what the data plane reads of records — a key's live record, a record by
//! id, a watch on its settlement elsewhere — with the rules of how long an answer lives
//! (docs/agents.md, key lifetime) applied here, so that no reader computes a cut-off of its own:
//! a done record is replayed until its route's retention ends, then remembered by a tombstone
//! that refuses the same request instead of executing it again.

use std::sync::Arc;

use crate::config::Config;
use crate::domain::clock::SharedClock;
use crate::domain::key::IdempotencyKey;
use crate::domain::{RecordId, State, Tenant};
use crate::problem::Problem;
use crate::record::Record;
use crate::store::{Store, StoreError};

#[derive(Clone)]
pub(crate) struct Records {
    store: Arc<dyn Store>,
    clock: SharedClock,
}

impl Records {
    pub(crate) fn new(store: Arc<dyn Store>, clock: SharedClock) -> Records {
        Records { store, clock }
    }

    /// The record of `tenant`'s `key`, unless it is a done record past its retention that the
    /// sweep has not removed yet: that one is read as gone. Retention is `config`'s: the
    /// configuration the request is served under.
    pub(crate) async fn live(
        &self,
        config: &Config,
        tenant: &Tenant,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        Ok(self.store.lookup(tenant, key).await?.filter(|record| !self.expired(config, record)))
    }

    pub(crate) async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.store.get(id).await
    }

    /// Asks the store to announce `id`'s settlement, should another node settle it.
    pub(crate) async fn watch(&self, id: RecordId) -> Result<(), StoreError> {
        self.store.watch(id).await
    }

    /// A done record whose answer is no longer kept: a tombstone, or past its retention and not
    /// yet swept. The same request is refused, never executed again (docs/agents.md).
    pub(crate) fn spent(&self, config: &Config, record: &Record) -> Option<Problem> {
        let spent = record.state == State::Done && (record.tombstone_until.is_some() || self.expired(config, record));
        let status = record.response.as_ref().map(|r| r.status);
        spent.then(|| Problem::result_expired(status, &record.updated_at.rfc3339()).state(State::Done))
    }

    /// Past its route's retention in `config` (a route no longer configured keeps the store's).
    fn expired(&self, config: &Config, record: &Record) -> bool {
        record.past_retention(config.lifetime_of(&record.route), self.clock.now())
    }
}
