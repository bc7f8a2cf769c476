--[[
  room_publish: copy a deal's waiting-room configuration into the room's hash, unless
  the hash already holds a newer one (gate/room/service.py Room.publish).

  Every path that writes a room's configuration (the admin PUT, the console's message
  edit, the room loop's refresh every few seconds, a mirror load) reads the deal's row
  with its `version` (bumped by every change of the row) and publishes it here. A
  refresh that read the row just before an operator's change must not put the old
  configuration back after the change was published: it would stand until the next
  refresh, and a removed room would stay on for good (the refresh reads open rooms
  only). So the hash keeps the version it was published from, and an older one is
  refused.

  KEYS[1] {d:ID}:room   hash   the room's configuration and counters ("ver": the
                               version of the deal row the configuration came from)
  ARGV[1] the deal row's version
  ARGV[2] n, the number of field/value pairs that follow
  ARGV[3 .. 2+2n]       field, value, ...: the fields to set ("on" = "0" removes the room)
  ARGV[3+2n ..]         fields to delete

  Returns {1, on}: published; on is the "on" field before ("" when absent)
          {0, on}: refused, the hash holds a newer version; nothing changed
]]
local version = tonumber(ARGV[1])
local held = tonumber(redis.call('HGET', KEYS[1], 'ver') or '-1')
local was_on = redis.call('HGET', KEYS[1], 'on') or ''
if held > version then
  return {0, was_on}
end
local n = tonumber(ARGV[2])
local set = {'ver', ARGV[1]}
for i = 3, 2 + 2 * n do
  set[#set + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], unpack(set))
if #ARGV > 2 + 2 * n then
  redis.call('HDEL', KEYS[1], unpack(ARGV, 3 + 2 * n))
end
return {1, was_on}
