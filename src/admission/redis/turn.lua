-- turn: if the lease is first in the queue and a slot is free, take the slot and reserve
-- (leaving the queue either way when the budget refuses). Each call also keeps the
-- caller's queue place alive.
-- KEYS: run grants queue qexp used
-- ARGV: max_concurrent budget prompt fan_out max_tokens lease month ttl_ms channel key_id
--       queue_ttl_ms
local run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local max_concurrent = tonumber(ARGV[1])
local budget, prompt, fan_out, max_tokens =
  tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease, month, ttl_us = ARGV[6], ARGV[7], tonumber(ARGV[8]) * 1000
local channel, key_id, queue_ttl_us = ARGV[9], ARGV[10], tonumber(ARGV[11]) * 1000

local now = now_us()
local purged, waiting = purge(run, grants, queue, qexp, now)
announce(channel, key_id, purged, waiting)

local expiry = redis.call('ZSCORE', qexp, lease)
if not expiry then
  return {GONE}
end
if tonumber(expiry) - now < queue_ttl_us / 2 then
  local until_us = now + queue_ttl_us
  redis.call('ZADD', qexp, int(until_us), lease)
  tidy(qexp, queue, until_us, 0)
end

if redis.call('ZRANGE', queue, 0, 0)[1] ~= lease then
  return {WAIT}
end
local slots = redis.call('ZCARD', run)
if slots >= max_concurrent then
  return {WAIT}
end
local used_tokens = redis.call('GET', used)
if not used_tokens then
  return {SEED}
end

redis.call('ZREM', queue, lease)
redis.call('ZREM', qexp, lease)
local reply = start(run, grants, tonumber(used_tokens), lease, month, budget, prompt, fan_out,
                   max_tokens, now, ttl_us, slots)
-- The next in line is first now (and may start too).
announce(channel, key_id, 1, waiting - 1)
return reply
