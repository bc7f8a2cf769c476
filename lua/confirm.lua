--[[
  confirm: the reservation committed in the database; retire its admission token,
  log it as resolved, and turn the idempotency marker into a "done" record pointing
  at the order. When the database took the units from other buckets than Redis
  chose (it falls over when a bucket disagrees), move the Redis counts to match.

  KEYS[1] meta            hash   {d:ID}:meta
  KEYS[2] buckets         hash   {d:ID}:b
  KEYS[3] inflight        hash   {d:ID}:f
  KEYS[4] inflight_times  zset   {d:ID}:ft
  KEYS[5] resolved        zset   {d:ID}:done
  KEYS[6] idempotency     string {d:ID}:k:USER:KEY

  ARGV[1] token (= order id)
  ARGV[2] request fingerprint
  ARGV[3] done-record TTL (seconds)
  ARGV[4] allocation the database committed "bucket:qty[,…]"
  ARGV[5] resolved-log retention (ms)

  Returns:
    1  the token was in flight and is now confirmed
    0  the token was already resolved (the janitor got there first); the next
       sync pass repairs any difference that leaves
]]
local token = ARGV[1]
local rec = redis.call('HGET', KEYS[3], token)
redis.call('SET', KEYS[6], 'D|' .. ARGV[2] .. '|' .. token, 'EX', ARGV[3])
if not rec then
  redis.call('ZREM', KEYS[4], token)
  return 0
end
redis.call('HDEL', KEYS[3], token)
redis.call('ZREM', KEYS[4], token)
local user, qty, alloc = string.match(rec, '^T|([^|]*)|([^|]*)|([^|]*)|')
if alloc ~= ARGV[4] then
  local nb = tonumber(redis.call('HGET', KEYS[1], 'nb'))
  if nb then
    for b, q in string.gmatch(alloc, '(%d+):(%d+)') do
      redis.call('HINCRBY', KEYS[2], tonumber(b) % nb, tonumber(q))
    end
    for b, q in string.gmatch(ARGV[4], '(%d+):(%d+)') do
      redis.call('HINCRBY', KEYS[2], tonumber(b) % nb, -tonumber(q))
    end
  end
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZADD', KEYS[5], now_ms, token .. '|C|' .. user .. '|' .. qty .. '|' .. ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now_ms - tonumber(ARGV[5]))
return 1
