-- leave: removes a waiting lease from the queue. Idempotent.
-- KEYS: run grants queue qexp
-- ARGV: lease channel key_id
local run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, channel, key_id = ARGV[1], ARGV[2], ARGV[3]

local changed = purge(run, grants, queue, qexp, now_us())
changed = changed + redis.call('ZREM', queue, lease)
redis.call('ZREM', qexp, lease)
if changed > 0 then
  redis.call('PUBLISH', channel, key_id)
end
return {DONE}
