-- Announcing every settled record serialises commits on PostgreSQL's notification queue. Only
-- records that a request elsewhere is waiting for need announcing: such a request marks the
-- record `watched` first, then re-reads it, so no settlement is missed.
ALTER TABLE records ADD COLUMN watched BOOLEAN NOT NULL DEFAULT FALSE;

DROP TRIGGER records_announce_update ON records;

-- Fires when a record becomes queued (from anything but queued), or when a watched record stops
-- being pending.
CREATE TRIGGER records_announce_update
    AFTER UPDATE OF state, queued ON records
    FOR EACH ROW
    WHEN ((NEW.state = 'not_started' AND NEW.queued AND NOT (OLD.state = 'not_started' AND OLD.queued))
       OR (NEW.watched
           AND (OLD.state = 'in_progress' OR (OLD.state = 'not_started' AND OLD.queued))
           AND NOT (NEW.state = 'in_progress' OR (NEW.state = 'not_started' AND NEW.queued))))
    EXECUTE FUNCTION records_announce();
