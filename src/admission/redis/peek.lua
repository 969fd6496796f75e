-- peek: whether admit would refuse the key now on its rate or on its full queue, taking
-- nothing (a refused request is then refused before its prompt is counted).
-- KEYS: rate run grants queue qexp
-- ARGV: rpm max_concurrent max_queued channel key_id
local rate, run, grants, queue, qexp = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local rpm, max_concurrent, max_queued = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local channel, key_id = ARGV[4], ARGV[5]

local now = now_us()
if rpm > 0 then
  local wait = rate_wait(rate, rpm, now)
  if wait > 0 then
    return {RATE_LIMITED, wait}
  end
end
local purged, waiting = purge(run, grants, queue, qexp, now)
announce(channel, key_id, purged, waiting)
-- As admit decides: a slot is taken only when nobody waits.
if (waiting > 0 or redis.call('ZCARD', run) >= max_concurrent) and waiting >= max_queued then
  return {QUEUE_FULL}
end
return {DONE}
