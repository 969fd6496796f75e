-- admit: rate, then a running slot with its reservation (only when nobody waits), or
-- the back of the queue, or a refusal. A refusal changes nothing but the rate.
-- KEYS: rate run grants queue qexp used
-- ARGV: rpm max_concurrent max_queued budget prompt fan_out max_tokens lease month
--       ttl_ms channel key_id queue_ttl_ms
local rate, run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local rpm = tonumber(ARGV[1])
local max_concurrent, max_queued = tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, prompt, fan_out, max_tokens =
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local lease, month, ttl_us = ARGV[8], ARGV[9], tonumber(ARGV[10]) * 1000
local channel, key_id, queue_ttl_us = ARGV[11], ARGV[12], tonumber(ARGV[13]) * 1000

-- A missing counter (new month, lost data) is seeded from the ledger by the caller,
-- who then calls again; nothing has changed yet.
local used_tokens = redis.call('GET', used)
if not used_tokens then
  return {SEED}
end

local now = now_us()
local purged, waiting = purge(run, grants, queue, qexp, now)
announce(channel, key_id, purged, waiting)

-- The rate first. rpm 0: a start not counted against the rate (a job's run, whose
-- submission was).
if rpm > 0 then
  local retry_after = take_rate(rate, rpm, now)
  if retry_after then
    return {RATE_LIMITED, retry_after}
  end
end

if waiting == 0 then
  local slots = redis.call('ZCARD', run)
  if slots < max_concurrent then
    return start(run, grants, tonumber(used_tokens), lease, month, budget, prompt, fan_out,
                 max_tokens, now, ttl_us, slots)
  end
end
if waiting >= max_queued then
  return {QUEUE_FULL}
end
local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')
local ticket = 1
if last[2] then
  ticket = tonumber(last[2]) + 1
end
local until_us = now + queue_ttl_us
redis.call('ZADD', queue, int(ticket), lease)
redis.call('ZADD', qexp, int(until_us), lease)
tidy(qexp, queue, until_us, 0)
return {QUEUED}
