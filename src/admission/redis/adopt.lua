-- adopt: moves up to `max` rows of a writer that is no longer alive from its journal
-- into the adopter's, and returns them ([request_id, row, ...]); nothing while the
-- writer is alive. Once its journal is empty the writer is forgotten.
-- KEYS: theirs ours writers their_alive
-- ARGV: their_id our_id max
local theirs, ours, writers, their_alive = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local their_id, our_id, max = ARGV[1], ARGV[2], ARGV[3]

if redis.call('EXISTS', their_alive) == 1 then
  return {}
end
local entries = redis.call('HSCAN', theirs, 0, 'COUNT', max)[2]
if #entries > 0 then
  redis.call('HSET', ours, unpack(entries))
  redis.call('SADD', writers, our_id)
  for i = 1, #entries, 2 do
    redis.call('HDEL', theirs, entries[i])
  end
end
if redis.call('EXISTS', theirs) == 0 then
  redis.call('SREM', writers, their_id)
end
return entries
