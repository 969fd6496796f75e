-- finish: releases a running slot (or a lapsed one, see LAPSED_KEEP_US) and settles its
-- reservation: the reservation is freed and `used_tokens` are added to the month's
-- counter, if that counter exists (if not, it is seeded from the ledger, which has
-- them). Idempotent: an unknown or finished lease changes nothing.
-- With a journal (KEYS 6-7, ARGV 6-8) the request's usage row is journaled under its
-- request id until the writer reports that id committed (journal.rs) — also when there
-- was no reservation left to settle (a retry, or a Redis that lost its data): the row
-- is what the ledger must get, whatever the counters know. The request id is the
-- lease's, but a job's for a run of a job (every run of it records under the job's id).
-- KEYS: run grants queue qexp used [journal writers]
-- ARGV: lease used_tokens month channel key_id [writer row request_id]
local run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, used_tokens, month, channel, key_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local journal, writers, writer, row, request_id = KEYS[6], KEYS[7], ARGV[6], ARGV[7], ARGV[8]

-- Lapsed slots and queue places are purged here only for somebody waiting: they are to
-- be woken if either went. Any other script purges before it counts them.
local changed, waiting = 0, redis.call('ZCARD', queue)
if waiting > 0 then
  changed, waiting = purge(run, grants, queue, qexp, now_us())
end
-- The reservation is found under the lease (running; or its slot set expired whole
-- while Redis stood still, before any purge could see it) or under '~'..lease (lapsed).
redis.call('ZREM', run, lease)
local found = redis.call('HMGET', grants, lease, '~' .. lease, '#running', '#lapsed',
                         '#sum:' .. month)
local settled = 0
if found[1] or found[2] then
  redis.call('HDEL', grants, lease, '~' .. lease)
  if found[3] then
    -- The bookkeeping without this reservation, written in one HSET (a reservation of
    -- another month than `month` is taken off its own sum apart; it should not happen).
    local counts = {tonumber(found[3]), tonumber(found[4] or 0)}
    local sum = tonumber(found[5] or 0)
    for i = 1, 2 do
      local value = found[i]
      if value then
        counts[i] = counts[i] - 1
        local m, reserved = string.match(value, '^(%S+) (%d+)')
        if m == month then
          sum = sum - tonumber(reserved)
        elseif m then
          redis.call('HINCRBY', grants, '#sum:' .. m, -tonumber(reserved))
        end
      end
    end
    redis.call('HSET', grants, '#running', counts[1], '#lapsed', counts[2],
               '#sum:' .. month, int(sum))
  end
  settled = 1
end
if settled == 1 and redis.call('EXISTS', used) == 1 then
  redis.call('INCRBY', used, used_tokens)
end
if journal and tonumber(used_tokens) > 0 then
  redis.call('HSET', journal, request_id, row)
  redis.call('SADD', writers, writer)
end
announce(channel, key_id, changed + settled, waiting)
return {DONE, settled}
