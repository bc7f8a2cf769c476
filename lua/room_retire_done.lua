--[[
  room_retire_done: settle a deal's entry in the rooms-to-retire index after
  room_retire.lua judged it (gate/room/retire.py), only if nobody scheduled it anew
  meanwhile (a room removed between the judgement and now keeps its entry).

  KEYS[1] gate:rooms:retiring   zset  deal -> when its room is due for retirement (ms)
  ARGV[1] deal id   ARGV[2] the score the retirer read   ARGV[3] the new score, or ""
  to remove the entry

  Returns 1 settled, 0 left as it is (the entry changed)
]]
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then
  return 0
end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
end
return 1
