-- leave: removes a waiting lease from the queue. Idempotent.
-- KEYS: run grants queue qexp
-- ARGV: lease channel key_id
local run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, channel, key_id = ARGV[1], ARGV[2], ARGV[3]

local changed, waiting = purge(run, grants, queue, qexp, now_us())
local left = redis.call('ZREM', queue, lease)
redis.call('ZREM', qexp, lease)
announce(channel, key_id, changed + left, waiting - left)
return {DONE}
