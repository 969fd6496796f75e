-- renew: extends the lease of a running slot (and its reservation). A slot that lapsed
-- while its request was still running (Redis stood still past the TTL, or renewals
-- were late) is taken back: the request is running, so it holds a slot.
-- KEYS: run grants queue qexp
-- ARGV: lease ttl_ms channel key_id
local run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, ttl_us, channel, key_id = ARGV[1], tonumber(ARGV[2]) * 1000, ARGV[3], ARGV[4]

local now = now_us()
announce(channel, key_id, purge(run, grants, queue, qexp, now))
local until_us = now + ttl_us
local until_ = int(until_us)
local found = 0
if redis.call('ZSCORE', run, lease) then
  redis.call('ZADD', run, 'XX', until_, lease)
  found = 1
elseif redis.call('HEXISTS', grants, lease) == 1 then
  -- The slot set expired whole while Redis stood still; the reservation is still here.
  redis.call('ZADD', run, until_, lease)
  found = 1
else
  local fields = redis.call('HMGET', grants, '~' .. lease, '#running')
  local lapsed = fields[1]
  if lapsed then
    local month, reserved = string.match(lapsed, '^(%S+) (%d+)')
    redis.call('HDEL', grants, '~' .. lease)
    redis.call('HSET', grants, lease, month .. ' ' .. reserved)
    count_moved(grants, '#lapsed', '#running', fields[2])
    redis.call('ZADD', run, until_, lease)
    found = 1
  end
end
tidy_run(run, grants, until_us)
return {DONE, found}
