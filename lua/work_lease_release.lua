--[[
  work_lease_release: a background loop that stops gives its kind's lease back
  (gate/store/work_lease.py), so that another process takes the work at its next pass
  instead of after the lease's TTL (a rolling restart pauses nothing). Only the
  holder's own lease is deleted: one that lapsed and was taken by another process
  is left alone.

  KEYS[1] lease  string {gate:bg}:KIND  the holder's owner id

  ARGV[1] the caller's owner id

  Returns:
    1  the caller held the lease; it is gone
    0  another process holds it, or nobody: nothing changed
]]
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
