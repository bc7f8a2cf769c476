--[[
  lease: a gate process's liveness lease and the record of its database connections
  (gate/store/process_lease.py). While the lease exists the process may be running reservation
  transactions; once it has lapsed it never comes back under the same owner id (a
  renewal only extends a lease that still exists; a process whose lease lapsed takes
  a new id). A connection is recorded before its first reservation transaction, and
  only while the lease exists, so a janitor that has seen the lease gone reads every
  connection on which a transaction of the owner's tokens may run.

  KEYS[1] lease   string {gate:o:OWNER}:lease  "host pid", TTL = the lease
  KEYS[2] conns   hash   {gate:o:OWNER}:conns  "_" -> "host pid";
                         server thread id -> connected at (Redis TIME, ms)

  ARGV[1] operation: "take" | "renew" | "thread"
  ARGV[2] lease TTL (ms)
  ARGV[3] connection record TTL (ms), refreshed with the lease
  ARGV[4] take: "host pid"; thread: the connection's server thread id
  ARGV[5] thread: the connection's age (ms), to date its opening on Redis' clock

  Returns:
    1  done
    0  take: the owner id exists already; renew, thread: the lease has lapsed (nothing
       changed: the caller must not use the connection, and takes a new owner id)
]]
local op = ARGV[1]
if op == 'take' then
  if not redis.call('SET', KEYS[1], ARGV[4], 'NX', 'PX', ARGV[2]) then
    return 0
  end
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], '_', ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
if redis.call('PEXPIRE', KEYS[1], ARGV[2]) == 0 then
  return 0
end
if op == 'thread' then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('HSET', KEYS[2], ARGV[4], now_ms - tonumber(ARGV[5]))
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
