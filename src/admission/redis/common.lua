-- Shared by every limiter script (prepended to each). Data of one API key, all in one
-- cluster slot through the hash tag `{key_id}`:
--   run     ZSET lease -> expiry (µs)          running slots
--   grants  HASH lease -> "YYYY-MM reserved"   the budget reservation of each running slot
--   queue   ZSET lease -> ticket               waiting leases, in arrival order
--   qexp    ZSET lease -> expiry (µs)          when each queue place lapses
--   used    STRING                             used tokens of the key in one month
--   rate    STRING                             GCRA theoretical arrival time (µs)
-- Time is Redis's own clock (TIME), shared by all replicas.

-- Reply codes (first element of every reply); mirrored in redis.rs.
local RUNNING, QUEUED, RATE_LIMITED, QUEUE_FULL, BUDGET, SEED, WAIT, GONE, DONE =
  0, 1, 2, 3, 4, 5, 6, 7, 8

-- Writes after TIME need effects replication (the default since Redis 5; a no-op there).
if redis.replicate_commands then redis.replicate_commands() end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- An integer as a string without exponent (tostring would give "1e+15").
local function int(x)
  return string.format('%.0f', x)
end

-- Removes running slots (with their reservations) and queue places whose lease lapsed.
-- Returns how many it removed.
local function purge(run, grants, queue, qexp, now)
  local n = 0
  for _, lease in ipairs(redis.call('ZRANGEBYSCORE', run, '-inf', int(now))) do
    redis.call('ZREM', run, lease)
    redis.call('HDEL', grants, lease)
    n = n + 1
  end
  for _, lease in ipairs(redis.call('ZRANGEBYSCORE', qexp, '-inf', int(now))) do
    redis.call('ZREM', qexp, lease)
    redis.call('ZREM', queue, lease)
    n = n + 1
  end
  return n
end

-- Lets a lease set and its companion vanish 1 s after their last lease lapses, so an
-- idle key leaves nothing behind.
local function tidy(expiries, companion)
  local last = redis.call('ZRANGE', expiries, -1, -1, 'WITHSCORES')
  if last[2] then
    local at = int(math.floor(tonumber(last[2]) / 1000) + 1000)
    redis.call('PEXPIREAT', expiries, at)
    redis.call('PEXPIREAT', companion, at)
  end
end

-- Tokens reserved by running slots against `month`.
local function reserved_in(grants, month)
  local sum = 0
  local all = redis.call('HGETALL', grants)
  for i = 2, #all, 2 do
    local m, n = string.match(all[i], '^(%S+) (%d+)$')
    if m == month then
      sum = sum + tonumber(n)
    end
  end
  return sum
end

-- Reserves the budget and takes a running slot, or refuses on the budget (changing
-- nothing). The caller has checked that the `used` counter exists.
local function start(run, grants, used_key, lease, month, budget, prompt, fan_out,
                     max_tokens, now, ttl_us)
  local used = tonumber(redis.call('GET', used_key) or 0)
  local reserved = reserved_in(grants, month)
  local available = math.max(budget - used - reserved, 0)
  local fit = 0
  if available >= prompt then
    fit = math.min(math.floor((available - prompt) / math.max(fan_out, 1)), max_tokens)
  end
  if fit < 1 then
    return {BUDGET, used, reserved, prompt + fan_out}
  end
  local hold = prompt + fan_out * fit
  redis.call('ZADD', run, int(now + ttl_us), lease)
  redis.call('HSET', grants, lease, month .. ' ' .. int(hold))
  tidy(run, grants)
  return {RUNNING, fit, hold}
end
