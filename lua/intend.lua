--[[
  intend: record intents before the database changes stock that Redis mirrors
  after the commit (a release, a stock adjustment). An intent says "this change
  may commit; Redis has not applied it". After the transaction the caller applies
  or drops each intent (apply.lua); an intent left by a gate that died is resolved
  by the janitor against the ledger (an intent committed iff ledger rows carry its
  id). Resync reads intents to tell applied changes from pending ones.

  KEYS[1] meta            hash {d:ID}:meta
  KEYS[2] inflight        hash {d:ID}:f
  KEYS[3] inflight_times  zset {d:ID}:ft

  ARGV[1] N, then N groups of 4:
          intent id, user id (0 = none), user quota delta, bucket deltas "b:d[,…]"

  Returns the number of intents recorded; 0 when the deal's state is absent (the
  next load reads the database, which will include the change once committed).
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local base = 2 + i * 4
  redis.call('HSET', KEYS[2], ARGV[base],
    'R|' .. ARGV[base + 1] .. '|' .. ARGV[base + 2] .. '|' .. ARGV[base + 3] .. '|' .. now_ms)
  redis.call('ZADD', KEYS[3], now_ms, ARGV[base])
end
return n
