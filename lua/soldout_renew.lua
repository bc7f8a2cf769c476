--[[
  soldout_renew: one read that tells a process whether its sold-out near-cache entry
  for a deal (or one partition of it) may be renewed (gate/reserve/soldout.py). A script
  call rather than a redis-py pipeline so that it travels in the hot path's pipeline
  (gate/store/scripts.py): under a sold-out flood the pipeline's round trip waited behind
  the process's own requests for 20-90 ms, longer than what was left of the entry.
  TIME is the clock of the node that holds the deal (the admission's clock).

  KEYS[1] meta     hash   {d:ID}:meta     avail, start_ms, end_ms, buyers_ok, max
  KEYS[2] buyers   set    {d:ID}:buyers

  Returns {avail, start_ms, end_ms, buyers_ok, max, buyers, now_ms}: the first five
  as HMGET gives them (false when absent: the deal is not loaded), buyers the size of
  the buyers set, now_ms Redis's clock in milliseconds.
]]
local r = redis.call('HMGET', KEYS[1], 'avail', 'start_ms', 'end_ms', 'buyers_ok', 'max')
local t = redis.call('TIME')
r[6] = redis.call('SCARD', KEYS[2])
r[7] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return r
