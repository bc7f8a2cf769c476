--[[
  admit: one reservation attempt's whole Redis part, in one call.

  Checks, in order of cost: the deal is loaded, the idempotency fast path, the sale
  window, the quantity bound (a buyer of the deal passes the rate limiters first),
  the sold-out state (losers are answered before any
  limiter runs), the rate limiters of this deal's slot (GCRA on Redis TIME, all or
  nothing: a refused request consumes no limiter), the per-user quota; then takes
  the quantity from the buckets (random start, falling over to the others; a
  quantity may span buckets) and records an in-flight token next to the decrement,
  so that the decrement can later be confirmed or given back exactly once.
  On a deal with a waiting room (gate/room/, docs/waiting-room.md) a reservation
  also needs an unspent, unexpired admission of this user, checked before the
  limiters and spent in the same call that takes the units.

  KEYS[1] meta            hash   {d:ID}:meta  nb, avail, start_ms, end_ms, max, limit,
                                               paused ("1": the sale is paused)
  KEYS[2] buckets         hash   {d:ID}:b     bucket -> available units
  KEYS[3] users           hash   {d:ID}:u     user id -> units held or bought
  KEYS[4] idempotency     string {d:ID}:k:USER:KEY  "P|fp|token" or "D|fp|order id"
  KEYS[5] inflight        hash   {d:ID}:f     token -> "T|user|qty|alloc|ms|key|fp|owner"
  KEYS[6] inflight_times  zset   {d:ID}:ft    token -> admission time (ms)
  KEYS[7] limit: deal     string {d:ID}:rl:d          theoretical arrival time (ms)
  KEYS[8] limit: user     string {d:ID}:rl:u:USER     (idem)
  KEYS[9] limit: ip       string {d:ID}:rl:i:IP       (idem)
  KEYS[10] limit: device  string {d:ID}:rl:v:DEVICE   (idem)
  KEYS[11] buyers         set    {d:ID}:buyers  users ever admitted (never shrinks):
          a gate may answer "sold out" from its near-cache only to users not in it
  KEYS[12] room           hash   {d:ID}:room  on ("1": the deal has a waiting room), spent;
          and, named from it, the admissions ring {d:ID}:room:rca (a spend: k, g, h)
  KEYS[13] room admitted  hash   {d:ID}:ra    user -> "seq|admitted_ms|expires_ms"
  KEYS[14] room expiry    zset   {d:ID}:rx    user -> expires_ms
  KEYS[15] queue          stream {d:ID}:q          } only for a deal in queue mode
  KEYS[16] queue status   string {d:ID}:q:o:TOKEN  } (gate/queuemode/, docs/queue-mode.md)
  KEYS[17] order index    string gate:q:i:TOKEN  queue mode on one Redis only (on Redis
          Cluster it is in another slot: lua/queue_index.lua writes it instead)

  ARGV[1] user id
  ARGV[2] quantity (integer >= 1, checked by the caller)
  ARGV[3] request fingerprint
  ARGV[4] token (the order id the reservation will get)
  ARGV[5] random non-negative integer choosing the start bucket
  ARGV[6] in-progress marker TTL (ms)
  ARGV[7] idempotency key (raw, as sent by the buyer)
  ARGV[8..15] per limiter of KEYS[7..10]: emission interval (ms), burst;
          an interval of 0 turns that limiter off
  ARGV[16] owner: the admitting process's lease id (gate/store/process_lease.py); a janitor
          resolves the token at once when that lease has lapsed
  ARGV[17] admission: "" no Admission-Token header, "-" a token that failed its
          signature, buyer, deal or expiry check (gate/room/tokens.py), "*" the
          operator's re-submission of a dead letter (gate queue retry: the request
          that died spent the buyer's admission; none is needed, none is spent;
          never derived from a header), else the admission sequence number the
          verified token names
  ARGV[18] queue mode only: requests the deal's queue may hold (GATE_QUEUE_DEPTH_MAX)
  ARGV[19] queue mode only: status TTL (ms), also the in-progress marker's and the
          order index's
  ARGV[20] with KEYS[17]: the order index's value, "deal id|user id"

  Queue mode (KEYS[15], KEYS[16] given): an admitted request is also appended to the
  deal's queue in this same call, its status set to "Q|enqueue ms|0" (and, given
  KEYS[17], the order's index written: GET /v1/orders/{id} finds it); its token goes
  to the in-flight hash but not to the in-flight times (the janitor walks only those:
  the stream entry owns a queued token, docs/queue-mode.md). The sync path's call is
  unchanged (14 keys): the branch costs it one comparison.

  Returns {code, detail}:
    0 OK              detail = allocation "bucket:qty[,bucket:qty…]"; a fourth
                      element is 1 when the user was in the buyers set before this
                      admission, or that set is not known to be complete (queue mode
                      then asks the database whether the request is a replay whose
                      record Redis lost), 0 otherwise
    1 NOT_LOADED      the deal's state is absent; load it from the database
    2 SOLD_OUT        detail = units left (less than asked); a third element gives
                      the size of the buyers set, or -1 while that set is not known
                      to be complete (after a load, until rebuilt from the database)
    3 NOT_ACTIVE      detail = "early" | "ended"
    4 BAD_QUANTITY    detail = max per order
    5 LIMIT_EXCEEDED  detail = per-user limit
    6 REPLAY          detail = order id of the earlier request with this key
    7 IN_PROGRESS     an earlier request with this key is still running; detail =
                      its token (in queue mode the order id it waits under)
    8 MISMATCH        this key was used with a different request
    9 RATE_LIMITED    detail = "scope|retry after (ms)"
   10 ADMISSION_REQUIRED  the deal has a waiting room and no token was sent
   11 ADMISSION_INVALID   the token names no unspent, unexpired admission of this user
   12 QUEUE_FULL      queue mode: the deal's queue holds ARGV[18] requests (nothing
                      taken, no limiter consumed)
   13 SALE_PAUSED     the deal's sale is paused (gate/inventory/pause.py): nothing taken,
                      no limiter consumed; answered after a replay (a buyer's earlier
                      request keeps its answer)
  Rejections 2, 3, 4, 5, 10 and 11 carry a fourth element, 1 when the user is in the
  buyers set: this request may then be a replay whose Redis record was lost (a
  flush), and the caller asks the database before answering. Rejection 9 does not:
  a 429 only says "later", and the retry finds the replay. The rate limiters judge
  every request that may reach the database that way (5 comes after them; 4 is
  answered before them only to users not in the buyers set).
]]
local meta = redis.call('HMGET', KEYS[1], 'nb', 'avail', 'start_ms', 'end_ms', 'max', 'limit',
  'buyers_ok', 'paused')
local nb = tonumber(meta[1])
if not nb then
  return {1, ''}
end

local fp = ARGV[3]
local seen = redis.call('GET', KEYS[4])
if seen then
  local state, seen_fp, ref = string.match(seen, '^(%a)|([^|]*)|(.*)$')
  if seen_fp ~= fp then
    return {8, ''}
  end
  if state == 'D' then
    return {6, ref}
  end
  return {7, ref}
end
-- A paused sale (its books broke, or an operator paused it) sells nothing more.
if meta[8] == '1' then
  return {13, ''}
end

-- Rejections below also say whether this user was ever admitted to the deal.
local function reject(code, detail, buyers)
  return {code, detail, buyers or -1, redis.call('SISMEMBER', KEYS[11], ARGV[1])}
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local start_ms = tonumber(meta[3]) or 0
local end_ms = tonumber(meta[4]) or 0
if start_ms > 0 and now_ms < start_ms then
  return reject(3, 'early')
end
if end_ms > 0 and now_ms >= end_ms then
  return reject(3, 'ended')
end

local qty = tonumber(ARGV[2])
local max = tonumber(meta[5]) or 1
-- A quantity above the maximum: anyone not in the buyers set is answered at once,
-- before the sold-out state (the near-cache relies on it). A buyer of the deal makes
-- the caller ask the database (a lost replay?), so the limiters judge that request
-- first, as they do before the quota.
local too_many = qty > max
if too_many then
  if redis.call('SISMEMBER', KEYS[11], ARGV[1]) == 0 then
    return {4, tostring(max), -1, 0}
  end
else
  local avail = tonumber(meta[2]) or 0
  if avail < qty then
    if avail < 0 then avail = 0 end
    local buyers = -1
    if meta[7] then buyers = redis.call('SCARD', KEYS[11]) end
    return reject(2, tostring(avail), buyers)
  end
end

-- Waiting room: after the answers every buyer may get (a replay, sold out, not
-- active), before the limiters (a refused request consumes none).
-- The operator's retry of a dead letter ("*") passes it: its admission was spent.
local room_on = ARGV[17] ~= '*' and redis.call('HGET', KEYS[12], 'on') == '1'
local admitted_ms
if room_on then
  local given = ARGV[17]
  if given == '' then
    return reject(10, '')
  end
  local held = redis.call('HGET', KEYS[13], ARGV[1])
  if not held then
    return reject(11, '')
  end
  local seq, expires
  seq, admitted_ms, expires = string.match(held, '^(%d+)|(%d+)|(%d+)$')
  if seq ~= given or tonumber(expires) <= now_ms then
    return reject(11, '')
  end
end

-- Queue mode: a full queue is answered before the limiters (a 503 consumes none).
local queued = #KEYS > 14
if queued and redis.call('XLEN', KEYS[15]) >= tonumber(ARGV[18]) then
  return {12, ''}
end

-- Rate limiters: judge every enabled scope first, write only if all admit.
local scopes = {'deal', 'user', 'ip', 'device'}
local tats = {}
local worst_scope, worst_wait = nil, 0
for i = 1, 4 do
  local interval = tonumber(ARGV[6 + 2 * i])
  if interval > 0 then
    local burst = tonumber(ARGV[7 + 2 * i])
    local tat = tonumber(redis.call('GET', KEYS[6 + i]) or '0')
    if tat < now_ms then tat = now_ms end
    local new_tat = tat + interval
    local wait = new_tat - burst * interval - now_ms
    if wait > 0 then
      if wait > worst_wait then worst_scope, worst_wait = scopes[i], wait end
    else
      tats[i] = new_tat
    end
  end
end
if worst_scope then
  return {9, worst_scope .. '|' .. worst_wait}
end
for i, new_tat in pairs(tats) do
  redis.call('SET', KEYS[6 + i], new_tat, 'PX', new_tat - now_ms + 1000)
end
if too_many then
  return {4, tostring(max), -1, 1}
end

local user = ARGV[1]
local limit = tonumber(meta[6]) or 0
local taken = 0
if limit > 0 then
  taken = tonumber(redis.call('HGET', KEYS[3], user) or '0')
  if taken + qty > limit then
    return reject(5, tostring(limit))
  end
end

-- Choose the parts first and write nothing until the whole quantity is covered, so
-- that a shortfall (buckets disagreeing with the total) leaves no trace.
local start = tonumber(ARGV[5]) % nb
local remaining = qty
local parts = {}
for i = 0, nb - 1 do
  local b = (start + i) % nb
  local have = tonumber(redis.call('HGET', KEYS[2], b) or '0')
  if have > 0 then
    local take = math.min(have, remaining)
    parts[#parts + 1] = {b, take}
    remaining = remaining - take
    if remaining == 0 then break end
  end
end
if remaining > 0 then
  local buyers = -1
  if meta[7] then buyers = redis.call('SCARD', KEYS[11]) end
  return reject(2, tostring(qty - remaining), buyers)
end

local alloc = {}
for i, part in ipairs(parts) do
  redis.call('HINCRBY', KEYS[2], part[1], -part[2])
  alloc[i] = part[1] .. ':' .. part[2]
end
local alloc_s = table.concat(alloc, ',')
redis.call('HINCRBY', KEYS[1], 'avail', -qty)
if limit > 0 then
  redis.call('HINCRBY', KEYS[3], user, qty)
end
local token = ARGV[4]
-- A queued request may wait longer than a synchronous one: its key's marker lives as
-- long as its status.
redis.call('SET', KEYS[4], 'P|' .. fp .. '|' .. token, 'PX', queued and ARGV[19] or ARGV[6])
redis.call('HSET', KEYS[5], token,
  'T|' .. user .. '|' .. qty .. '|' .. alloc_s .. '|' .. now_ms .. '|' .. ARGV[7] .. '|' .. fp
    .. '|' .. ARGV[16])
if queued then
  redis.call('XADD', KEYS[15], '*', 'token', token, 'user', user, 'qty', qty,
    'alloc', alloc_s, 'key', ARGV[7], 'fp', fp, 'ms', now_ms)
  redis.call('SET', KEYS[16], 'Q|' .. now_ms .. '|0', 'PX', ARGV[19])
  if KEYS[17] then
    redis.call('SET', KEYS[17], ARGV[20], 'PX', ARGV[19])
  end
else
  redis.call('ZADD', KEYS[6], now_ms, token)
end
-- SADD answers 0 for a member already there: a buyer admitted to the deal before.
-- While the set is being rebuilt from the database (no buyers_ok) anyone may be one.
local known = 1 - redis.call('SADD', KEYS[11], user)
if not meta[7] then known = 1 end
if room_on then
  -- The admission is spent with the units it bought: it cannot buy twice.
  redis.call('HDEL', KEYS[13], user)
  redis.call('ZREM', KEYS[14], user)
  redis.call('HINCRBY', KEYS[12], 'spent', 1)
  -- The admissions ring (gate/room/conversion.py, key KEYS[12] .. ':rca'): the spend
  -- and its delay in the admission's slot, if that slot still counts it.
  local ring = KEYS[12] .. ':rca'
  local given_ms = tonumber(admitted_ms)
  local slot = math.floor(given_ms / 1000)
  local i = slot % 256
  if redis.call('HGET', ring, 't:' .. i) == tostring(slot) then
    local ln = math.log(math.max(now_ms - given_ms, 1))
    redis.call('HINCRBY', ring, 'k:' .. i, 1)
    redis.call('HINCRBY', ring, 'g:' .. i, math.floor(1000 * ln + 0.5))
    redis.call('HINCRBY', ring, 'h:' .. i, math.floor(1000 * ln * ln + 0.5))
  end
end
return {0, alloc_s, -1, known}
