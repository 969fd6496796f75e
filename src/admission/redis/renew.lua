-- renew: extends the lease of a running slot (and its reservation) or a queue place.
-- KEYS: run grants queue qexp
-- ARGV: lease ttl_ms channel key_id
local run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, ttl_us, channel, key_id = ARGV[1], tonumber(ARGV[2]) * 1000, ARGV[3], ARGV[4]

local now = now_us()
if purge(run, grants, queue, qexp, now) > 0 then
  redis.call('PUBLISH', channel, key_id)
end
local until_ = int(now + ttl_us)
local found = redis.call('ZADD', run, 'XX', 'CH', until_, lease)
  + redis.call('ZADD', qexp, 'XX', 'CH', until_, lease)
tidy(run, grants)
tidy(qexp, queue)
return {DONE, found}
