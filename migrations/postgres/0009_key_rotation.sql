-- Key rotation and expiry. Expand-only: columns are added, nothing is dropped or
-- renamed, so a server of the previous version keeps working on this schema during a
-- rollout (it ignores the new columns: it neither expires keys nor knows a previous
-- secret). Same columns and meanings as the SQLite schema; times are Unix seconds.
--
-- expires_at:          when the key stops working; NULL: never.
-- previous_key_hash:   SHA-256 of the secret the last rotation replaced, which keeps
--                      working until previous_expires_at (the grace period); NULL when
--                      the rotation gave no grace (or the key was never rotated). Only
--                      the newest previous secret is kept: rotating again replaces it.
-- previous_expires_at: when the previous secret stops working.
ALTER TABLE api_keys ADD COLUMN expires_at BIGINT;
ALTER TABLE api_keys ADD COLUMN previous_key_hash BYTEA
    CHECK (previous_key_hash IS NULL OR octet_length(previous_key_hash) = 32);
ALTER TABLE api_keys ADD COLUMN previous_expires_at BIGINT;

-- A change of these columns is a key change too: it takes a change number and is
-- announced on `fleetgate_keys` (migration 0003's function), so other servers see a
-- rotation or a new expiry at once. A trigger of its own rather than migration 0008's
-- replaced (nothing is dropped): a rotation, which also sets key_hash, fires both
-- triggers and takes two change numbers (the row keeps the later), which readers do not
-- mind (they read every change numbered above the last they saw).
CREATE TRIGGER api_keys_feed_rotation BEFORE UPDATE OF expires_at, previous_key_hash,
    previous_expires_at ON api_keys FOR EACH ROW EXECUTE FUNCTION api_keys_feed();
