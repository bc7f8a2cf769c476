--[[
  work_lease: one holder at a time for a kind of background work (the janitor, the
  resync loop, the invariant monitor) across every gate process and host
  (gate/store/work_lease.py). The holder extends its lease before each pass; another
  process takes it only once it has lapsed (its holder stopped or died).

  KEYS[1] lease  string {gate:bg}:KIND  the holder's owner id, TTL = the lease

  ARGV[1] the caller's owner id
  ARGV[2] lease TTL (ms)

  Returns:
    1  the caller holds the lease (taken or extended): run the pass
    0  another process holds it: skip the pass
]]
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
