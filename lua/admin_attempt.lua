--[[
  admin_attempt: one attempt at the admin token by one client address
  (gate/web/admin_guard.py AdminAttempts), or a look at the address's window. A
  sliding window: the address's attempts of the last window_ms, one sorted-set
  member each, scored by its time; one more is taken only below the bound. Judged
  by Redis TIME, so exact across gate processes.

  KEYS[1] attempts  sorted set  member per attempt, score = its time (ms)

  ARGV[1] window (ms, >= 1)
  ARGV[2] attempts allowed in the window (>= 1)
  ARGV[3] a member unique to this attempt, or "" to look only (nothing is taken)

  Returns:
    0   taken (looking: the address is below the bound)
    >0  refused: the ms until the oldest attempt leaves the window
]]
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - window)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(oldest[2]) + window - now_ms)
end
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[1], now_ms, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
end
return 0
