--[[
  room_challenge: what a join's proof of work costs now (gate/room/gates.py):
  the room's bounds and its demand, read together.

  KEYS[1] room   hash  {d:ID}:room  on, pow_min, pow_max (absent: no challenge)
  KEYS[2] queue  zset  {d:ID}:rq    the waiting tickets
  KEYS[3] meta   hash  {d:ID}:meta  avail (the mirror's)

  Returns {0, min_bits, max_bits, waiting, available}, or a refusal (RoomCode):
    {4} NOT_LOADED   the deal's state is absent; load it from the database
    {5} NO_ROOM      the deal has no waiting room
    {15} NO_CHALLENGE the room asks no challenge
]]
local avail = redis.call('HGET', KEYS[3], 'avail')
if not avail then
  return {4}
end
local cfg = redis.call('HMGET', KEYS[1], 'on', 'pow_min', 'pow_max')
if cfg[1] ~= '1' then
  return {5}
end
local low = tonumber(cfg[2])
if not low then
  return {15}
end
local n = tonumber(avail)
if n < 0 then n = 0 end
return {0, low, tonumber(cfg[3]) or low, redis.call('ZCARD', KEYS[2]), n}
