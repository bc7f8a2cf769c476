--[[
  room_advance: one step of a deal's waiting room on Redis time. Called by every
  gate process's room loop (gate/room/service.py); atomic, so any number of callers
  is safe and none leads. Bounded work per call: at most ARGV[2] admissions and
  ARGV[3] lapses.

    1. lapse: unspent admissions past their expiry return their slot
    2. admit: pop the lowest queue scores (prequeue joiners in random order, then
       FIFO), as many as all of these allow:
         bound   unspent admissions <= ceil(available units x ratio)
                 "auto" (a decision at most STALE_MS old, gate/room/steering.py):
                 unspent admissions given at or after ayoung
                 < floor(available x aratio + aoffset), the rate arate
         rate    admissions in the last 1000 ms of Redis time < admit_per_second
                 (a sliding-window log: exact across processes), and per call at
                 most the share of the time since the previous call (smoothing)
         window  the sale has started and not ended
         pause   the sale is not paused (gate/inventory/pause.py): tickets keep their
                 places, nobody is admitted

  KEYS[1] room       hash   {d:ID}:room  on, aps, ttl_ms, last_ms, aseq, admitted, lapsed
  KEYS[2] queue      zset   {d:ID}:rq    user -> score
  KEYS[3] tickets    hash   {d:ID}:rt    user -> "joined_ms|next_poll_ms"
  KEYS[4] admitted   hash   {d:ID}:ra    user -> "seq|admitted_ms|expires_ms"
  KEYS[5] expiry     zset   {d:ID}:rx    user -> expires_ms
  KEYS[6] window     zset   {d:ID}:rw    seq -> admitted_ms (the last second)
  KEYS[7] meta       hash   {d:ID}:meta  nb, avail, start_ms, end_ms, paused (the mirror's)
  KEYS[8] ring       hash   {d:ID}:room:rca  the admissions ring (gate/room/conversion.py):
                            n in the slot of now, per admission given

  ARGV[1] ratio (admissions per available unit, > 0)
  ARGV[2] admissions per call, at most
  ARGV[3] lapses per call, at most
  ARGV[4] how long after ends_at the tickets are kept (ms)

  Returns {code, admitted, lapsed, "wait_ms,wait_ms,…" (join to admission)}
    0 OK   1 NOT_LOADED (no deal state: nothing done)   2 NO_ROOM
    3 DONE  the sale ended more than ARGV[4] ago: the caller schedules the room's
            retirement (gate/room/retire.py, lua/room_retire.lua)
]]
local STALE_MS = 3000
local RING_SLOTS, RING_TTL_MS = 256, 600000
local cfg = redis.call('HMGET', KEYS[1], 'on', 'aps', 'ttl_ms', 'last_ms', 'auto', 'arate',
  'aratio', 'aoffset', 'ayoung', 'aat')
if cfg[1] ~= '1' then
  return {2, 0, 0, ''}
end
local meta = redis.call('HMGET', KEYS[7], 'nb', 'avail', 'start_ms', 'end_ms', 'paused')
if not meta[1] then
  return {1, 0, 0, ''}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local end_ms = tonumber(meta[4]) or 0
if end_ms > 0 and now_ms >= end_ms + tonumber(ARGV[4]) then
  return {3, 0, 0, ''}
end

-- 1. Lapses.
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[3]))
if #lapsed > 0 then
  redis.call('HDEL', KEYS[4], unpack(lapsed))
  redis.call('ZREM', KEYS[5], unpack(lapsed))
  redis.call('HINCRBY', KEYS[1], 'lapsed', #lapsed)
end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now_ms - 1000)

-- 2. Admissions.
local start_ms = tonumber(meta[3]) or 0
if (start_ms > 0 and now_ms < start_ms) or (end_ms > 0 and now_ms >= end_ms)
    or meta[5] == '1' then
  return {0, 0, #lapsed, ''}
end
local aps = tonumber(cfg[2]) or 1
local ttl_ms = tonumber(cfg[3]) or 120000
local avail = tonumber(meta[2]) or 0
if avail < 0 then avail = 0 end
local unspent = redis.call('HLEN', KEYS[4])
local room_for
local aat = tonumber(cfg[10])
if cfg[5] == '1' and aat and now_ms - aat <= STALE_MS then
  -- The automatic rate's decision (gate/room/steering.py): its bound over the young.
  aps = tonumber(cfg[6]) or aps
  local young = redis.call('ZCOUNT', KEYS[5], tonumber(cfg[9]) + ttl_ms, '+inf')
  room_for = math.floor(avail * tonumber(cfg[7]) + tonumber(cfg[8]) + 1e-9) - young
else
  -- "auto" without a fresh decision (its decider stalled, or not yet run): a tenth
  -- of the cap, the slow start's first step, and the fixed bound below.
  if cfg[5] == '1' then aps = math.max(1, math.floor(aps / 10)) end
  room_for = math.ceil(avail * tonumber(ARGV[1])) - unspent
end
local rate_left = aps - redis.call('ZCARD', KEYS[6])
local since = 1000
if cfg[4] then since = math.min(1000, math.max(0, now_ms - tonumber(cfg[4]))) end
local share = math.ceil(aps * since / 1000)
redis.call('HSET', KEYS[1], 'last_ms', now_ms)
local k = math.min(room_for, rate_left, share, tonumber(ARGV[2]))
if k <= 0 then
  return {0, 0, #lapsed, ''}
end
local popped = redis.call('ZPOPMIN', KEYS[2], k)
local waits = {}
local expires = now_ms + ttl_ms
for i = 1, #popped, 2 do
  local user = popped[i]
  local seq = redis.call('HINCRBY', KEYS[1], 'aseq', 1)
  redis.call('HSET', KEYS[4], user, seq .. '|' .. now_ms .. '|' .. expires)
  redis.call('ZADD', KEYS[5], expires, user)
  redis.call('ZADD', KEYS[6], now_ms, seq)
  local record = redis.call('HGET', KEYS[3], user)
  local joined = record and tonumber(string.match(record, '^(%d+)|')) or now_ms
  waits[#waits + 1] = now_ms - joined
end
local n = #popped / 2
redis.call('HINCRBY', KEYS[1], 'admitted', n)
-- The admissions ring: n in the slot of now (cleared first when it held an older one).
local slot = math.floor(now_ms / 1000)
local i = slot % RING_SLOTS
if redis.call('HGET', KEYS[8], 't:' .. i) ~= tostring(slot) then
  redis.call('HDEL', KEYS[8], 'n:' .. i, 'k:' .. i, 'g:' .. i, 'h:' .. i, 'lv:' .. i, 'ex:' .. i)
  redis.call('HSET', KEYS[8], 't:' .. i, slot)
end
redis.call('HINCRBY', KEYS[8], 'n:' .. i, n)
redis.call('PEXPIRE', KEYS[8], RING_TTL_MS)
return {0, n, #lapsed, table.concat(waits, ',')}
