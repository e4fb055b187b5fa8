-- How a streamed answer went (SPEC §11), as JSON: bytes received, whether the body is stored
-- (within the route's max_stored_body), where a cut stream ended, time to first byte and the
-- stream's duration. NULL for an answer read whole. Written before the outcome, under the lease.
ALTER TABLE records ADD COLUMN stream jsonb;
