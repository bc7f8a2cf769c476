--[[
  apply: resolve intents after their transaction. An intent that committed is
  applied to the counters (bucket deltas, total, per-user quota); one that did not
  is dropped. Only the call that removes the intent acts, so the request and the
  janitor can never apply a change twice.

  KEYS[1] meta            hash {d:ID}:meta
  KEYS[2] buckets         hash {d:ID}:b
  KEYS[3] users           hash {d:ID}:u
  KEYS[4] inflight        hash {d:ID}:f
  KEYS[5] inflight_times  zset {d:ID}:ft
  KEYS[6] resolved        zset {d:ID}:done

  ARGV[1] resolved-log retention (ms)
  ARGV[2] N, then N groups of 2: intent id, "1" committed (apply) or "0" (drop)

  Returns the number of intents applied now.
]]
local nb = tonumber(redis.call('HGET', KEYS[1], 'nb'))
local limit = tonumber(redis.call('HGET', KEYS[1], 'limit') or '0')
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local n = tonumber(ARGV[2])
local applied = 0
-- The counters move once per bucket for the whole call (a release of 500 holds
-- touches a few buckets), not once per intent: the script runs atomically, so
-- nothing can read the counters in between.
local sums = {}
local total = 0
for i = 0, n - 1 do
  local id = ARGV[3 + i * 2]
  local rec = redis.call('HGET', KEYS[4], id)
  if rec then
    redis.call('HDEL', KEYS[4], id)
    redis.call('ZREM', KEYS[5], id)
    if ARGV[4 + i * 2] == '1' and nb then
      local user, units, deltas = string.match(rec, '^R|([^|]*)|([^|]*)|([^|]*)|')
      for b, d in string.gmatch(deltas, '(%d+):(-?%d+)') do
        local bucket = tonumber(b) % nb
        sums[bucket] = (sums[bucket] or 0) + tonumber(d)
        total = total + tonumber(d)
      end
      units = tonumber(units)
      if limit > 0 and units ~= 0 and user ~= '0' then
        local left = redis.call('HINCRBY', KEYS[3], user, units)
        if left <= 0 then
          redis.call('HDEL', KEYS[3], user)
        end
      end
      redis.call('ZADD', KEYS[6], now_ms, id .. '|A|' .. user .. '|' .. units .. '|' .. deltas)
      applied = applied + 1
    end
  end
end
for bucket, d in pairs(sums) do
  if d ~= 0 then
    redis.call('HINCRBY', KEYS[2], bucket, d)
  end
end
if total ~= 0 then
  redis.call('HINCRBY', KEYS[1], 'avail', total)
end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now_ms - tonumber(ARGV[1]))
return applied
