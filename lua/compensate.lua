--[[
  compensate: the database did not take the reservation; give the Redis decrement
  back, exactly once. Only the call that removes the admission token restores
  anything, so a retried or concurrent compensation (the request itself and the
  janitor) can never give the units back twice.

  KEYS[1] meta            hash   {d:ID}:meta
  KEYS[2] buckets         hash   {d:ID}:b
  KEYS[3] users           hash   {d:ID}:u
  KEYS[4] idempotency     string {d:ID}:k:USER:KEY
  KEYS[5] inflight        hash   {d:ID}:f
  KEYS[6] inflight_times  zset   {d:ID}:ft

  ARGV[1] token

  Returns:
    1  the token was in flight; its units, quota and marker are restored
    0  the token was already resolved; nothing changed
]]
local token = ARGV[1]
local rec = redis.call('HGET', KEYS[5], token)
if not rec then
  return 0
end
redis.call('HDEL', KEYS[5], token)
redis.call('ZREM', KEYS[6], token)
local user, qty, alloc = string.match(rec, '^T|([^|]*)|([^|]*)|([^|]*)|')
qty = tonumber(qty)
local nb = tonumber(redis.call('HGET', KEYS[1], 'nb'))
if nb then
  for b, q in string.gmatch(alloc, '(%d+):(%d+)') do
    redis.call('HINCRBY', KEYS[2], tonumber(b) % nb, tonumber(q))
  end
  redis.call('HINCRBY', KEYS[1], 'avail', qty)
  local limit = tonumber(redis.call('HGET', KEYS[1], 'limit') or '0')
  if limit > 0 then
    local left = redis.call('HINCRBY', KEYS[3], user, -qty)
    if left <= 0 then
      redis.call('HDEL', KEYS[3], user)
    end
  end
end
local marker = redis.call('GET', KEYS[4])
if marker and string.sub(marker, 1, 2) == 'P|' and string.sub(marker, -#token) == token then
  redis.call('DEL', KEYS[4])
end
return 1
