-- A fencing token per claim: each claim of a record (a claimed admission, a single or bulk claim)
-- adds one, and every write made under a claim is guarded by the token that claim was given, not
-- by the holder's name. A worker whose claim was taken over and given again (to another node or
-- to its own) is refused, whatever its name. Kept when the lease ends, so a late outcome and a
-- probe can still name the claim they answer for (docs/guarantees.md).
ALTER TABLE records ADD COLUMN claim_token bigint NOT NULL DEFAULT 0;

-- idem_end_attempts (0011), guarded by each outcome's claim token instead of its owner's name.
-- The twelve-argument form stays for nodes of the previous version still running.
CREATE FUNCTION idem_end_attempts(
    ids uuid[], tokens bigint[], new_attempts jsonb[], states text[], stops text[], statuses integer[],
    headers jsonb[], bodies bytea[], nows bigint[], queueds boolean[], not_befores bigint[],
    streams jsonb[]
) RETURNS TABLE (ended uuid, cancel_requested boolean)
LANGUAGE plpgsql AS $$
DECLARE
    flag boolean;
BEGIN
    FOR i IN 1 .. coalesce(array_length(ids, 1), 0) LOOP
        UPDATE records AS r SET
            attempts = r.attempts || COALESCE(new_attempts[i], '[]'::jsonb),
            in_flight_number = NULL, in_flight_started_at = NULL,
            state = states[i], queued = queueds[i],
            not_before = CASE WHEN queueds[i] THEN r.not_before ELSE not_befores[i] END,
            lease_owner = CASE WHEN states[i] = 'in_progress' THEN r.lease_owner END,
            lease_expires_at = CASE WHEN states[i] = 'in_progress' THEN r.lease_expires_at END,
            stop_reason = stops[i], response_status = statuses[i], response_headers = headers[i],
            response_body = bodies[i], done_at = CASE WHEN states[i] = 'done' THEN nows[i] END,
            stream = COALESCE(streams[i], r.stream),
            updated_at = nows[i]
        WHERE r.id = ids[i] AND r.state IS NOT DISTINCT FROM 'in_progress' AND r.claim_token = tokens[i]
        RETURNING r.cancel_requested INTO flag;
        IF FOUND THEN
            ended := ids[i];
            cancel_requested := flag;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
