--[[
  room_restore: give a buyer back the admission its own reservation spent when that
  reservation never held stock and is about to be tried once more.

  Only the reservation path calls it, and only in one case: the admission succeeded
  (spending the buyer's admission), then the transaction was not sent because the
  process's lease was found lapsed (Redis flushed or failed over), the units were
  given back (compensate.lua) and the request is tried again under a fresh lease
  (gate/reserve/path.py `_after_lapse`). Without this the retry would find the admission spent
  and answer ADMISSION_INVALID to a buyer who bought nothing. The admission's
  sequence number and expiry come from the buyer's verified Admission-Token.

  KEYS[1] room       hash   {d:ID}:room  on, spent
  KEYS[2] admitted   hash   {d:ID}:ra    user -> "seq|admitted_ms|expires_ms"
  KEYS[3] expiry     zset   {d:ID}:rx    user -> expires_ms

  ARGV[1] user id
  ARGV[2] the admission's sequence number (from the token)
  ARGV[3] the admission's expiry, ms since the epoch (from the token)

  Returns:
    1  restored
    0  nothing to do: no room, the buyer holds an admission, or it has expired
]]
if redis.call('HGET', KEYS[1], 'on') ~= '1' then
  return 0
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 0
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = tonumber(ARGV[3])
if expires <= now_ms then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. now_ms .. '|' .. ARGV[3])
redis.call('ZADD', KEYS[3], expires, ARGV[1])
if tonumber(redis.call('HGET', KEYS[1], 'spent') or '0') > 0 then
  redis.call('HINCRBY', KEYS[1], 'spent', -1)
end
return 1
