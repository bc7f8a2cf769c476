--[[
  room_retire: delete a retired waiting room's keys, if it is still retired when
  asked (gate/room/retire.py; the deal's keys stay). Retired means either
    removed  the room is off (PUT …/waiting-room null), or
    over     the sale ended at least the room's admission TTL ago (by Redis TIME):
             every ticket then reads "closed" and every admission has expired.
  A removed room's keys are all deleted; an ended sale's room keeps its hash's
  configuration fields. A room turned on again, or whose sale was extended, is
  live: nothing is deleted.
  The keys are UNLINKed: their memory is freed off Redis's main thread, so a room of
  a million tickets never blocks Redis.

  KEYS[1] room  KEYS[2] queue  KEYS[3] tickets  KEYS[4] admitted  KEYS[5] expiry
  KEYS[6] window (the room_*.lua order)           KEYS[7] meta (the mirror's: end_ms)
  KEYS[8] draw (the ticket ids drawn: the fairness document's participants)
  KEYS[9] codes (the access codes' working copy; their home is the database).
          Deleted with a removed room (setting a room to "codes" copies them back);
          kept by an ended sale's room, which a sale extended later brings back
          to life without a copy.

  KEYS[10] left (the buyers who left the line: lua/room_leave.lua), deleted with the
          tickets

  (and, named from KEYS[1], the admissions ring KEYS[1] .. ':rca', gate/store/keys.py
  room_ring, deleted with the admissions it counts)

  ARGV[1] how long an ended sale's draw list is kept, for the fairness document (ms)

  Returns {1, 0}     deleted
          {0, due}   over, but not for another while: due (ms) is when it will be
          {0, 0}     live (or the deal's state is absent: not judged): kept
]]
local cfg = redis.call('HMGET', KEYS[1], 'on', 'ttl_ms')
if cfg[1] == '1' then
  local end_ms = tonumber(redis.call('HGET', KEYS[7], 'end_ms')) or 0
  if end_ms <= 0 then
    return {0, 0}
  end
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = end_ms + (tonumber(cfg[2]) or 120000)
  if now_ms < due then
    return {0, due}
  end
  -- Over: the room's configuration stays (a few fields), so that its buyers are
  -- still told the sale has ended (a join: NOT_ACTIVE; a read: NO_TICKET); its
  -- counters go with the admissions they count (gate check's balance holds: 0).
  redis.call('UNLINK', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[10],
    KEYS[1] .. ':rca')
  redis.call('HDEL', KEYS[1], 'seq', 'aseq', 'last_ms', 'admitted', 'spent', 'lapsed')
  -- The estimates (gate/room/estimate.py) go with them: a sale extended later
  -- starts its chance and its automatic rate afresh.
  redis.call('HDEL', KEYS[1], 'ch', 'chat', 'arate', 'aratio', 'aoffset', 'ayoung', 'aat',
    'aceil', 'acut', 'aprobe', 'areason', 'adetail', 'adm_prev')
  -- The draw stays published for a while (anyone may check it), then goes too.
  redis.call('PEXPIRE', KEYS[8], tonumber(ARGV[1]))
  return {1, 0}
end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8],
  KEYS[9], KEYS[10], KEYS[1] .. ':rca')
return {1, 0}
