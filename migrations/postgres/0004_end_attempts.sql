-- The outcomes of attempts that ended at the same moment, stored by one call: one round trip and
-- one commit for all of them. Row by row it is the store's one-attempt update: the record is found
-- by its id, and its state checked with IS NOT DISTINCT FROM, a form no index can serve, so the
-- primary key is the only way in (with `state = 'in_progress'`, the planner may scan the partial
-- index `records_leases` whole). Returns the records whose lease the caller still held.
CREATE FUNCTION idem_end_attempts(
    ids uuid[], owners text[], new_attempts jsonb[], states text[], stops text[], statuses integer[],
    headers jsonb[], bodies bytea[], nows bigint[], queueds boolean[], not_befores bigint[]
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
            updated_at = nows[i]
        WHERE r.id = ids[i] AND r.state IS NOT DISTINCT FROM 'in_progress' AND r.lease_owner = owners[i]
        RETURNING r.cancel_requested INTO flag;
        IF FOUND THEN
            ended := ids[i];
            cancel_requested := flag;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
