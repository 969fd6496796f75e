-- Shared by every limiter script (prepended to each). Data of one API key, all in one
-- cluster slot through the hash tag `{key_id}`:
--   run     ZSET lease -> expiry (µs)          running slots
--   grants  HASH lease -> "YYYY-MM reserved"   the budget reservation of each running slot;
--                '~'..lease -> "YYYY-MM reserved lapsed_at"  a slot whose lease lapsed
--                (its replica died, or Redis stood still past the TTL): its reservation
--                still counts, and a late finish still settles it, for LAPSED_KEEP_US;
--                '#running', '#lapsed' -> how many of each there are, and
--                '#sum:'..month -> their reserved tokens in that month: kept with every
--                change, so that a month's reservations are summed without reading
--                them all (see reserved_in). Only a full count (recount) or a start
--                right after reserved_in creates them; every other change touches them
--                only where '#running' is there, so bookkeeping that went missing (or
--                that an older version moved aside) stays missing until recounted,
--                rather than starting again from 0 beside reservations it never saw.
--   queue   ZSET lease -> ticket               waiting leases, in arrival order
--   qexp    ZSET lease -> expiry (µs)          when each queue place lapses
--   used    STRING                             used tokens of the key in one month
--   rate    STRING                             GCRA theoretical arrival time (µs)
-- Time is Redis's own clock (TIME), shared by all replicas.

-- Reply codes (first element of every reply); mirrored in limiter.rs.
local RUNNING, QUEUED, RATE_LIMITED, QUEUE_FULL, BUDGET, SEED, WAIT, GONE, DONE =
  0, 1, 2, 3, 4, 5, 6, 7, 8

-- How long the reservation of a lapsed slot keeps counting (µs), waiting for a late
-- finish or renew. A replica that died never sends either: its reservations come back
-- after this, its slots at once.
local LAPSED_KEEP_US = 120 * 1000000

-- Writes after TIME need effects replication (the default since Redis 5; a no-op there).
if redis.replicate_commands then redis.replicate_commands() end

-- Redis's clock, read once per script (every call is a round trip into Redis, TIME
-- one of the dearest): a script runs atomically, so one reading serves all of it.
local script_now_us
local function now_us()
  if not script_now_us then
    local t = redis.call('TIME')
    script_now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return script_now_us
end

-- An integer as a string without exponent (tostring would give "1e+15").
local function int(x)
  return string.format('%.0f', x)
end

-- GCRA on the key `rate`: a burst of `rpm` starts, then one every 60 s / rpm. How long
-- (µs) until a start is allowed (0: now), and the key's arrival time after that start.
local function rate_wait(rate, rpm, now)
  local interval = math.floor(60000000 / rpm)
  local tolerance = interval * (rpm - 1)
  local tat = math.max(tonumber(redis.call('GET', rate) or now), now)
  return math.max(tat - tolerance - now, 0), tat + interval
end

-- Counts one start against the rate and returns nil, or returns how long (µs) until a
-- start would be allowed.
local function take_rate(rate, rpm, now)
  local wait, next_tat = rate_wait(rate, rpm, now)
  if wait > 0 then
    return wait
  end
  redis.call('SET', rate, int(next_tat), 'PX', int(math.ceil((next_tat - now) / 1000) + 1000))
  return nil
end

-- How much longer than it must a key is let live when its expiry is pushed on: a busy
-- key's expiry is then written about once per EXPIRY_SLACK_MS, not with every change
-- (PTTL alone costs one call, PTTL and PEXPIREAT two). An idle key is gone that much later.
local EXPIRY_SLACK_MS = 10000

-- Lets `key` expire no sooner than `at_ms` (Unix ms). Never brings an expiry forward, so
-- a key outlives everything that was ever promised it. (Compared here rather than with
-- PEXPIREAT's GT flag, which needs Redis 7.)
local function expire_no_sooner(key, at_ms)
  local ttl = redis.call('PTTL', key)
  if ttl == -2 then
    return
  end
  local now_ms = math.floor(now_us() / 1000)
  if ttl == -1 or now_ms + ttl < at_ms then
    redis.call('PEXPIREAT', key, int(at_ms + EXPIRY_SLACK_MS))
  end
end

-- A reservation moved between running and lapsed: same tokens, one fewer of counter
-- `from` and one more of `to` (where the bookkeeping is kept: `kept`).
local function count_moved(grants, from, to, kept)
  if not kept then
    return
  end
  redis.call('HINCRBY', grants, from, -1)
  redis.call('HINCRBY', grants, to, 1)
end

-- Removes running slots and queue places whose lease lapsed; a lapsed slot's
-- reservation is kept aside as '~'..lease (see LAPSED_KEEP_US). The queue's lapsed
-- places are looked for only when somebody waits. Returns how many it removed and how
-- many wait in the queue now.
local function purge(run, grants, queue, qexp, now)
  local n = 0
  for _, lease in ipairs(redis.call('ZRANGEBYSCORE', run, '-inf', int(now))) do
    redis.call('ZREM', run, lease)
    local found = redis.call('HMGET', grants, lease, '#running')
    local grant = found[1]
    redis.call('HDEL', grants, lease)
    if grant then
      redis.call('HSET', grants, '~' .. lease, grant .. ' ' .. int(now))
      count_moved(grants, '#running', '#lapsed', found[2])
      expire_no_sooner(grants, math.floor(now / 1000) + LAPSED_KEEP_US / 1000 + 1000)
    end
    n = n + 1
  end
  local waiting = redis.call('ZCARD', queue)
  if waiting > 0 then
    for _, lease in ipairs(redis.call('ZRANGEBYSCORE', qexp, '-inf', int(now))) do
      redis.call('ZREM', qexp, lease)
      waiting = waiting - redis.call('ZREM', queue, lease)
      n = n + 1
    end
  end
  return n, waiting
end

-- Wakes the key's waiters on every replica (they check their turn) after `changed`
-- slots or queue places went; only when somebody waits, since nobody else listens.
local function announce(channel, key_id, changed, waiting)
  if changed > 0 and waiting > 0 then
    redis.call('PUBLISH', channel, key_id)
  end
end

-- Lets the lease set `expiries` and its companion outlive a lease that runs until
-- `until_us`: the set by 1 s, the companion by `keep_ms` more; so an idle key leaves
-- nothing behind.
local function tidy(expiries, companion, until_us, keep_ms)
  local at = math.floor(until_us / 1000) + 1000
  expire_no_sooner(expiries, at)
  expire_no_sooner(companion, at + keep_ms)
end

-- tidy for the running slots: the grants outlive them by LAPSED_KEEP_US.
local function tidy_run(run, grants, until_us)
  tidy(run, grants, until_us, LAPSED_KEEP_US / 1000)
end

-- Reads every reservation: drops lapsed ones kept long enough; sets aside as lapsed now
-- a running one whose slot is gone without a purge having seen it (the slot set expired
-- whole while Redis stood still), so that it too is dropped once kept long enough; and
-- writes the bookkeeping anew from what is left (which also mends bookkeeping that is
-- missing, as for reservations made before it was kept). Returns `month`'s sum and how
-- many reservations are running.
local function recount(run, grants, month, now)
  local running_set = {}
  for _, lease in ipairs(redis.call('ZRANGE', run, 0, -1)) do
    running_set[lease] = true
  end
  local all = redis.call('HGETALL', grants)
  local running, lapsed, sums, stale = 0, 0, {}, {}
  for i = 2, #all, 2 do
    local field, value = all[i - 1], all[i]
    local kind = string.sub(field, 1, 1)
    if kind == '#' then
      stale[#stale + 1] = field
    else
      local m, n, lapsed_at = string.match(value, '^(%S+) (%d+) ?(%d*)$')
      local kept = true
      if kind == '~' then
        if now - (tonumber(lapsed_at) or 0) > LAPSED_KEEP_US then
          redis.call('HDEL', grants, field)
          kept = false
        else
          lapsed = lapsed + 1
        end
      elseif running_set[field] then
        running = running + 1
      else
        redis.call('HDEL', grants, field)
        redis.call('HSET', grants, '~' .. field, value .. ' ' .. int(now))
        lapsed = lapsed + 1
      end
      if kept and m then
        sums[m] = (sums[m] or 0) + tonumber(n)
      end
    end
  end
  if #stale > 0 then
    redis.call('HDEL', grants, unpack(stale))
  end
  -- Only beside reservations: bookkeeping alone would keep an idle key's hash alive.
  if running + lapsed > 0 then
    local fields = {'#running', running, '#lapsed', lapsed}
    for m, n in pairs(sums) do
      fields[#fields + 1] = '#sum:' .. m
      fields[#fields + 1] = n
    end
    redis.call('HSET', grants, unpack(fields))
  end
  return sums[month] or 0, running
end

-- Tokens reserved against `month` by running slots and by lapsed ones still kept, and how
-- many reservations are running: as kept, when the bookkeeping shows nothing that needs
-- a look (no lapsed reservation to drop in time, and a reservation for each of the
-- `slots` running slots); else counted anew.
local function reserved_in(run, grants, month, now, slots)
  local kept = redis.call('HMGET', grants, '#running', '#lapsed', '#sum:' .. month)
  if kept[1] and tonumber(kept[2] or 0) == 0 and tonumber(kept[1]) == slots then
    return tonumber(kept[3] or 0), slots
  end
  return recount(run, grants, month, now)
end

-- Reserves the budget and takes a running slot, or refuses on the budget (changing
-- nothing). `used`: the month's counter, which the caller has read (it exists);
-- `slots`: how many slots are running (ZCARD run, which the caller has read).
local function start(run, grants, used, lease, month, budget, prompt, fan_out,
                     max_tokens, now, ttl_us, slots)
  local reserved, running = reserved_in(run, grants, month, now, slots)
  local available = math.max(budget - used - reserved, 0)
  local fit = 0
  if available >= prompt then
    fit = math.min(math.floor((available - prompt) / math.max(fan_out, 1)), max_tokens)
  end
  if fit < 1 then
    return {BUDGET, used, reserved, prompt + fan_out}
  end
  local hold = prompt + fan_out * fit
  local until_us = now + ttl_us
  redis.call('ZADD', run, int(until_us), lease)
  -- The bookkeeping as reserved_in just read (or wrote) it, with this reservation.
  redis.call('HSET', grants, lease, month .. ' ' .. int(hold), '#running', running + 1,
             '#sum:' .. month, int(reserved + hold))
  tidy_run(run, grants, until_us)
  return {RUNNING, fit, hold}
end
