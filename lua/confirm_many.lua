--[[
  confirm_many: several reservations of one deal committed in the database (a
  reservation group, or single reservations confirmed in the same event-loop turn);
  for each, exactly what confirm.lua does for one: retire its admission token, log it
  as resolved, turn its idempotency marker into a "done" record pointing at the order,
  and move the Redis counts where the database took other buckets than Redis chose.
  One call instead of one per reservation (docs/hotpath.md).

  KEYS[1] meta            hash   {d:ID}:meta
  KEYS[2] buckets         hash   {d:ID}:b
  KEYS[3] inflight        hash   {d:ID}:f
  KEYS[4] inflight_times  zset   {d:ID}:ft
  KEYS[5] resolved        zset   {d:ID}:done
  KEYS[5 + i] idempotency string {d:ID}:k:USER:KEY of the i-th reservation (i = 1..n)

  ARGV[1] done-record TTL (seconds)
  ARGV[2] resolved-log retention (ms)
  ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]  the i-th reservation's token
          (= order id), request fingerprint, and the allocation the database committed
          "bucket:qty[,…]"

  Returns an array of n codes, in order, each as confirm.lua's:
    1  the token was in flight and is now confirmed
    0  the token was already resolved (the janitor got there first); the next
       sync pass repairs any difference that leaves
]]
local n = #KEYS - 5
local out = {}
local nb = nil
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for i = 1, n do
  local token = ARGV[3 * i]
  local fp = ARGV[3 * i + 1]
  local committed = ARGV[3 * i + 2]
  local rec = redis.call('HGET', KEYS[3], token)
  redis.call('SET', KEYS[5 + i], 'D|' .. fp .. '|' .. token, 'EX', ARGV[1])
  redis.call('ZREM', KEYS[4], token)
  if not rec then
    out[i] = 0
  else
    redis.call('HDEL', KEYS[3], token)
    local user, qty, alloc = string.match(rec, '^T|([^|]*)|([^|]*)|([^|]*)|')
    if alloc ~= committed then
      if nb == nil then
        nb = tonumber(redis.call('HGET', KEYS[1], 'nb')) or false
      end
      if nb then
        for b, q in string.gmatch(alloc, '(%d+):(%d+)') do
          redis.call('HINCRBY', KEYS[2], tonumber(b) % nb, tonumber(q))
        end
        for b, q in string.gmatch(committed, '(%d+):(%d+)') do
          redis.call('HINCRBY', KEYS[2], tonumber(b) % nb, -tonumber(q))
        end
      end
    end
    redis.call('ZADD', KEYS[5], now_ms, token .. '|C|' .. user .. '|' .. qty .. '|' .. committed)
    out[i] = 1
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now_ms - tonumber(ARGV[2]))
return out
