--[[
  deal_pause: mirror a deal's pause (the deals row's paused_at, gate/inventory/pause.py)
  into its Redis state, which lua/admit.lua and lua/room_advance.lua read already.

  Written only into a state that exists: a field alone in an absent meta hash would
  make the deal look loaded (lua/sync_deal.lua builds it only when absent) and never
  be built. An absent state takes the flag from the database when it is loaded.

  KEYS[1] meta  hash {d:ID}:meta
  ARGV[1] "1" paused, "0" selling

  Returns 1 written, 0 no state in Redis.
]]
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'paused', ARGV[1])
return 1
