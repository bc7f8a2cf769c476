--[[
  queue_ack: settled queued requests leave their deal's queue, in one call for a
  whole batch: acknowledged in the consumer group, deleted from the stream (XLEN is
  the depth), and the statuses of committed ones deleted (the order is in the
  database now). Called only once each outcome is in Redis (confirmed, or rejected
  and compensated), so a consumer killed before it leaves the entries to another.

  KEYS[1]    stream   stream {d:ID}:q
  KEYS[2..]  status   string {d:ID}:q:o:TOKEN of each committed request (may be none)

  ARGV[1]    consumer group
  ARGV[2..]  stream entry ids

  Returns the number of entries acknowledged.
]]
if #ARGV < 2 then
  return 0
end
local ids = {}
for i = 2, #ARGV do
  ids[#ids + 1] = ARGV[i]
end
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
redis.call('XDEL', KEYS[1], unpack(ids))
if #KEYS > 1 then
  local statuses = {}
  for i = 2, #KEYS do
    statuses[#statuses + 1] = KEYS[i]
  end
  redis.call('DEL', unpack(statuses))
end
return acked
