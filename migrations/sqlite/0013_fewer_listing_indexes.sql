-- Fewer B-trees per write (docs/performance.md#fewer-b-trees-per-write). Every record was in
-- `records_listing_by_state`, and every change of its state moved its entry there: a new key's
-- insert and each of its state changes wrote one more B-tree, for listings of states that few
-- records are in. Those are now served by partial indexes that a new key on its way to `done`
-- never enters:
--
-- * queued records by `records_queued` (created_at), ties by id sorted on the way;
-- * free records (`not_started`, not queued) by `records_free` below;
-- * in-progress records by `records_leases`, all of them read and sorted: as many as there are
--   leases, bounded by the work in flight;
-- * unknown records by `records_listing_unknown` below;
-- * done records, and listings of every state, by `records_listing` (created_at, id), which the
--   stats, canary judging and recorded history also read a range of.
--
-- The count of records by state reads these partial indexes and the count of the whole table.
-- Nothing here writes to `records`, so the protocol's triggers stay as they are.
DROP INDEX records_listing_by_state;
CREATE INDEX records_free ON records (created_at, id) WHERE state = 'not_started' AND queued = 0;
CREATE INDEX records_listing_unknown ON records (created_at, id) WHERE state = 'unknown';
