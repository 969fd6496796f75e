-- rate: counts one start against a key's rate, and nothing else (a request that takes
-- no slot and no budget: the Workbench's routes).
-- KEYS: rate
-- ARGV: rpm (at least 1)
local retry_after = take_rate(KEYS[1], tonumber(ARGV[1]), now_us())
if retry_after then
  return {RATE_LIMITED, retry_after}
end
return {DONE}
