--[[
  sync_deal: make a deal's Redis counters equal to what a database snapshot implies,
  exactly, with reservations and releases in flight. See docs/redis-mirror.md for
  the proof sketch; in short, the caller
    t0  reads Redis TIME,
    1.  opens a consistent database snapshot,
    2.  reads the in-flight markers and the markers resolved since t0,
    3.  asks the snapshot which of those operations committed (ledger op ids; for
        reservations also the allocation the database took),
    4.  calls this script, which walks the markers as they are *now*:
          T token, not committed in the snapshot: Redis took its units, the
            snapshot did not                              -> want -= alloc
          T token, committed: both took it, Redis from its own buckets, which the
            confirmation will move to the database's       -> want += db alloc - alloc
          R intent, committed: the snapshot has the change, Redis not yet
                                                          -> want -= deltas
          R intent, not committed: neither has it         -> nothing
        and the markers resolved since t0:
          C confirmed token not committed in the snapshot -> want -= alloc
          A applied intent not committed in the snapshot  -> want += deltas
        Markers resolved before t0 committed before the snapshot and are in both.
  want = database available + those adjustments, per bucket; Redis is set to it
  (load, layout) or moved to it by exact deltas (resync).

  KEYS[1] meta            hash {d:ID}:meta
  KEYS[2] buckets         hash {d:ID}:b
  KEYS[3] users           hash {d:ID}:u
  KEYS[4] inflight        hash {d:ID}:f
  KEYS[5] inflight_times  zset {d:ID}:ft
  KEYS[6] resolved        zset {d:ID}:done

  ARGV[1]  mode: "load" (build if absent), "layout" (rebuild buckets, keep per-user
           counts), "resync" (repair drift by deltas)
  ARGV[2]  t0 (Redis TIME, ms) read before the snapshot was opened
  ARGV[3]  longest allowed pass (ms): a slower pass changes nothing (the resolved log
           it relies on is kept only a little longer than this)
  ARGV[4]  bucket count nb
  ARGV[5]  sale start (ms since epoch, 0 = none)
  ARGV[6]  sale end (ms since epoch, 0 = none)
  ARGV[7]  max per order
  ARGV[8]  per-user limit (0 = none)
  ARGV[9]  layout epoch
  ARGV[10] "1" the deal's sale is paused, "0" it sells (deals.paused_at,
           gate/inventory/pause.py): meta's "paused", read by lua/admit.lua
  ARGV[11] K, then K committed operations: "id" or "id=allocation" (reservations)
  then     nb database available counts, bucket 0 first
  then     U, then U pairs (user id, units) of the snapshot's quota (load mode)
  then     optional: P, the deal's partition count, given only when P > 1 (KEYS are
           then one partition's, its buckets' counts given, the others' 0; meta
           records "pp" so that a gate routes buyers before it knows the deal)

  Returns {code, detail}:
    0 ""   load: the state already existed, nothing changed
    1 ""   built (load, layout), or resync found Redis exact
    2 sig  resync repaired drift "bucket:delta,…,a:delta", or "layout" when Redis had
           another bucket count and was rebuilt to the database's
    4 ""   the pass took too long; nothing changed
    5 ""   resync: the deal's state is absent; nothing changed
]]
local mode = ARGV[1]
local t0 = tonumber(ARGV[2])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if now_ms - t0 > tonumber(ARGV[3]) then
  return {4, ''}
end
local exists = redis.call('EXISTS', KEYS[1]) == 1
if mode == 'load' and exists then
  return {0, ''}
end
if mode == 'resync' and not exists then
  return {5, ''}
end

local nb = tonumber(ARGV[4])
local k = tonumber(ARGV[11])
local committed = {}
for i = 1, k do
  local id, alloc = string.match(ARGV[11 + i], '^([^=]+)=?(.*)$')
  committed[id] = alloc
end
local pos = 12 + k
local want = {}
for b = 0, nb - 1 do
  want[b] = tonumber(ARGV[pos + b])
end
pos = pos + nb

local users_adj = {}
local function shift(parts, sign)
  for b, q in string.gmatch(parts, '(%d+):(-?%d+)') do
    local mb = tonumber(b) % nb
    want[mb] = want[mb] + sign * tonumber(q)
  end
end
local function shift_user(user, units)
  if user ~= '0' and units ~= 0 then
    users_adj[user] = (users_adj[user] or 0) + units
  end
end

-- The walk is the script's cost (a queue-mode deal may have a marker per queued
-- request): a reservation's user and quantity are read only where they are used
-- (load mode's per-user counts), and a one-bucket allocation "b:q" is shifted without
-- an iterator.
local with_users = mode == 'load'
local match, sub, tonum = string.match, string.sub, tonumber
local recs = redis.call('HGETALL', KEYS[4])
for i = 1, #recs, 2 do
  local id, rec = recs[i], recs[i + 1]
  if sub(rec, 1, 2) == 'T|' then
    local c = committed[id]
    if c then
      shift(c, 1)
    end
    if with_users then
      local user, qty, alloc = match(rec, '^T|([^|]*)|([^|]*)|([^|]*)|')
      shift(alloc, -1)
      if not c then
        shift_user(user, tonum(qty))
      end
    else
      local b, q = match(rec, '^T|[^|]*|[^|]*|(%d+):(%d+)|')
      if b then
        local mb = tonum(b) % nb
        want[mb] = want[mb] - tonum(q)
      else
        shift(match(rec, '^T|[^|]*|[^|]*|([^|]*)|'), -1)
      end
    end
  elseif committed[id] then
    local user, units, deltas = string.match(rec, '^R|([^|]*)|([^|]*)|([^|]*)|')
    shift(deltas, -1)
    shift_user(user, -tonumber(units))
  end
end
local done = redis.call('ZRANGEBYSCORE', KEYS[6], t0, '+inf')
for _, entry in ipairs(done) do
  local id, kind, user, units, parts = string.match(entry, '^([^|]*)|(%a)|([^|]*)|([^|]*)|(.*)$')
  if not committed[id] then
    if kind == 'C' then
      shift(parts, -1)
      shift_user(user, tonumber(units))
    else
      shift(parts, 1)
      shift_user(user, tonumber(units))
    end
  end
end

local meta_fields = {'nb', nb, 'start_ms', ARGV[5], 'end_ms', ARGV[6], 'max', ARGV[7],
  'limit', ARGV[8], 'epoch', ARGV[9], 'paused', ARGV[10]}
local pp = ARGV[pos + 1 + 2 * tonumber(ARGV[pos])]
if pp then
  meta_fields[#meta_fields + 1] = 'pp'
  meta_fields[#meta_fields + 1] = pp
end
local total = 0
for b = 0, nb - 1 do total = total + want[b] end

if mode ~= 'resync' or tonumber(redis.call('HGET', KEYS[1], 'nb')) ~= nb then
  redis.call('DEL', KEYS[2])
  for b = 0, nb - 1 do
    redis.call('HSET', KEYS[2], b, want[b])
  end
  redis.call('HSET', KEYS[1], unpack(meta_fields))
  redis.call('HSET', KEYS[1], 'avail', total)
  if mode == 'load' then
    redis.call('DEL', KEYS[3])
    local u = tonumber(ARGV[pos])
    for i = 1, u do
      local user = ARGV[pos + 2 * i - 1]
      users_adj[user] = (users_adj[user] or 0) + tonumber(ARGV[pos + 2 * i])
    end
    if tonumber(ARGV[8]) > 0 then
      for user, units in pairs(users_adj) do
        if units > 0 then
          redis.call('HSET', KEYS[3], user, units)
        end
      end
    end
  end
  if mode == 'resync' then
    return {2, 'layout'}
  end
  return {1, ''}
end

redis.call('HSET', KEYS[1], unpack(meta_fields))
local sig = {}
local have = redis.call('HGETALL', KEYS[2])
local seen = {}
for i = 1, #have, 2 do
  local b = tonumber(have[i])
  if b >= nb then
    -- A bucket of an older layout: its units are counted in the new layout.
    redis.call('HDEL', KEYS[2], have[i])
  else
    seen[b] = tonumber(have[i + 1])
  end
end
for b = 0, nb - 1 do
  local d = want[b] - (seen[b] or 0)
  if d ~= 0 then
    redis.call('HINCRBY', KEYS[2], b, d)
    sig[#sig + 1] = b .. ':' .. d
  end
end
local have_total = tonumber(redis.call('HGET', KEYS[1], 'avail') or '0')
if have_total ~= total then
  redis.call('HINCRBY', KEYS[1], 'avail', total - have_total)
  sig[#sig + 1] = 'a:' .. (total - have_total)
end
if #sig == 0 then
  return {1, ''}
end
return {2, table.concat(sig, ',')}
