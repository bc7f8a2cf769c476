--[[
  enqueue: hand an admitted request over to its deal's queue (queue mode,
  docs/queue-mode.md), right after admit.lua took its units.

  The admission token stays in the in-flight hash (its units count as in flight for
  resync and `gate check`), but leaves the in-flight times: the janitor walks only
  those, so it never resolves a queued token as an orphan. From here on the queue
  owns the token: a consumer confirms it (committed) or compensates it (rejected,
  cancelled, dead letter), and the stream's consumer group keeps the entry until one
  of them has (a dead consumer's entries are claimed by another).

  KEYS[1] inflight        hash   {d:ID}:f
  KEYS[2] inflight_times  zset   {d:ID}:ft
  KEYS[3] stream          stream {d:ID}:q
  KEYS[4] status          string {d:ID}:q:o:TOKEN

  ARGV[1] token (order id)
  ARGV[2] cap: requests the deal's queue may hold
  ARGV[3] status TTL (ms)
  ARGV[4] user id
  ARGV[5] quantity
  ARGV[6] allocation "bucket:qty[,…]"
  ARGV[7] idempotency key
  ARGV[8] fingerprint

  Returns {code, detail}:
    0 QUEUED   detail = stream entry id
    1 GONE     the token is no longer in flight (nothing queued)
    2 FULL     the queue holds `cap` requests (nothing queued; the caller compensates)
]]
local token = ARGV[1]
if redis.call('HEXISTS', KEYS[1], token) == 0 then
  return {1, ''}
end
if redis.call('XLEN', KEYS[3]) >= tonumber(ARGV[2]) then
  return {2, ''}
end
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = redis.call('XADD', KEYS[3], '*', 'token', token, 'user', ARGV[4], 'qty', ARGV[5],
  'alloc', ARGV[6], 'key', ARGV[7], 'fp', ARGV[8], 'ms', ms)
redis.call('ZREM', KEYS[2], token)
redis.call('SET', KEYS[4], 'Q|' .. ms .. '|0', 'PX', ARGV[3])
return {0, id}
