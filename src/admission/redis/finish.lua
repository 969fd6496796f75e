-- finish: releases a running slot and settles its reservation: the reservation is
-- freed and `used_tokens` are added to the month's counter, if that counter exists (if
-- not, it is seeded from the ledger, which already has them). Idempotent: an unknown or
-- finished lease changes nothing.
-- KEYS: run grants queue qexp used
-- ARGV: lease used_tokens channel key_id
local run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, used_tokens, channel, key_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local changed = purge(run, grants, queue, qexp, now_us())
local settled = redis.call('ZREM', run, lease)
if settled == 1 then
  redis.call('HDEL', grants, lease)
  if redis.call('EXISTS', used) == 1 then
    redis.call('INCRBY', used, used_tokens)
  end
end
if changed + settled > 0 then
  redis.call('PUBLISH', channel, key_id)
end
return {DONE, settled}
