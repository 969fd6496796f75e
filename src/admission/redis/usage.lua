-- usage: used and reserved tokens of a key for a month.
-- KEYS: run grants queue qexp used
-- ARGV: month channel key_id
local run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local month, channel, key_id = ARGV[1], ARGV[2], ARGV[3]

local now = now_us()
announce(channel, key_id, purge(run, grants, queue, qexp, now))
local count = redis.call('GET', used)
if not count then
  return {SEED}
end
local reserved = reserved_in(run, grants, month, now, redis.call('ZCARD', run))
return {DONE, tonumber(count), reserved}
