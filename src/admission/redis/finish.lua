-- finish: releases a running slot (or a lapsed one, see LAPSED_KEEP_US) and settles its
-- reservation: the reservation is freed and `used_tokens` are added to the month's
-- counter, if that counter exists (if not, it is seeded from the ledger, which has
-- them). Idempotent: an unknown or finished lease changes nothing.
-- With a journal (KEYS 6-7, ARGV 5-6) the request's usage row is journaled under the
-- lease until the writer reports it committed (journal.rs) — also when there was no
-- reservation left to settle (a retry, or a Redis that lost its data): the row is
-- what the ledger must get, whatever the counters know.
-- KEYS: run grants queue qexp used [journal writers]
-- ARGV: lease used_tokens channel key_id [writer row]
local run, grants, queue, qexp, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, used_tokens, channel, key_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local journal, writers, writer, row = KEYS[6], KEYS[7], ARGV[5], ARGV[6]

local changed = purge(run, grants, queue, qexp, now_us())
-- The reservation is found under the lease (running; or its slot set expired whole
-- while Redis stood still, before any purge could see it) or under '~'..lease (lapsed).
redis.call('ZREM', run, lease)
local found = redis.call('HMGET', grants, lease, '~' .. lease, '#running')
local settled = 0
if found[1] or found[2] then
  redis.call('HDEL', grants, lease, '~' .. lease)
  if found[1] then
    uncount(grants, found[1], '#running', found[3])
  end
  if found[2] then
    uncount(grants, found[2], '#lapsed', found[3])
  end
  settled = 1
end
if settled == 1 and redis.call('EXISTS', used) == 1 then
  redis.call('INCRBY', used, used_tokens)
end
if journal and tonumber(used_tokens) > 0 then
  redis.call('HSET', journal, lease, row)
  redis.call('SADD', writers, writer)
end
if changed + settled > 0 then
  redis.call('PUBLISH', channel, key_id)
end
return {DONE, settled}
