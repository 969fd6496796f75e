-- occupancy: running and waiting leases of a key.
-- KEYS: run grants queue qexp
-- ARGV: channel key_id
local run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local channel, key_id = ARGV[1], ARGV[2]

local purged, waiting = purge(run, grants, queue, qexp, now_us())
announce(channel, key_id, purged, waiting)
return {DONE, redis.call('ZCARD', run), waiting}
