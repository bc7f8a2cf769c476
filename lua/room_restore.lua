--[[
  room_restore: give a buyer back the admission its own reservation spent when that
  reservation never held stock: its units were given back (compensate.lua) and the
  buyer may try again with the same Admission-Token.

  Only the reservation path calls it (gate/reserve/path.py): the admission succeeded
  (spending the buyer's admission), then the transaction was not sent because the
  process's lease was found lapsed (`_after_lapse`, tried again at once), or the
  database failed (a 503) or the global limiter refused it (a 429) and the units
  were given back. Without this the retry would find the admission spent and answer
  ADMISSION_INVALID to a buyer who bought nothing. The admission's sequence number
  and expiry come from the buyer's verified Admission-Token.

  Within the room's bound, as room_advance.lua admits: the unspent admissions, this
  one included, at most ceil(available x ratio). Otherwise the units went to another
  admission meanwhile, and restoring would admit more buyers than units left.

  KEYS[1] room       hash   {d:ID}:room  on, spent
  KEYS[2] admitted   hash   {d:ID}:ra    user -> "seq|admitted_ms|expires_ms"
  KEYS[3] expiry     zset   {d:ID}:rx    user -> expires_ms
  KEYS[4] meta       hash   {d:ID}:meta  avail (the mirror's)

  ARGV[1] user id
  ARGV[2] the admission's sequence number (from the token)
  ARGV[3] the admission's expiry, ms since the epoch (from the token)
  ARGV[4] the room's ratio (GATE_ROOM_ADMISSION_RATIO)

  Returns:
    1  restored
    0  nothing to do: no room, the buyer holds an admission, it has expired, or the
       room's bound has no place for it
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
local avail = tonumber(redis.call('HGET', KEYS[4], 'avail')) or 0
if redis.call('HLEN', KEYS[2]) + 1 > math.ceil(avail * tonumber(ARGV[4])) then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. now_ms .. '|' .. ARGV[3])
redis.call('ZADD', KEYS[3], expires, ARGV[1])
if tonumber(redis.call('HGET', KEYS[1], 'spent') or '0') > 0 then
  redis.call('HINCRBY', KEYS[1], 'spent', -1)
end
return 1
