--[[
  queue_cancel: the buyer cancels a queued request (or the request path rejects one
  its admission queued: the global limiter refused it, its index was not written).
  Only a request still waiting ("Q") is cancelled; the caller then gives its units back (compensate.lua, which acts
  once). A consumer that takes the entry later finds "X|CANCELLED" and only makes
  sure the units went back.

  KEYS[1] status  string {d:ID}:q:o:TOKEN

  ARGV[1] status TTL (ms)
  ARGV[2] reason (optional, default CANCELLED): the status becomes "X|REASON"

  Returns {code, detail}:
    0 CANCELLED
    1 COMMITTING  a consumer is committing it: the caller answers 409, retry later
    2 FINAL       detail = "X|REASON": already rejected or cancelled
    3 UNKNOWN     no such queued request
]]
local st = redis.call('GET', KEYS[1])
if not st then
  return {3, ''}
end
local kind = string.sub(st, 1, 1)
if kind == 'X' then
  return {2, st}
end
if kind == 'C' then
  return {1, ''}
end
redis.call('SET', KEYS[1], 'X|' .. (ARGV[2] or 'CANCELLED'), 'PX', ARGV[1])
return {0, ''}
