--[[
  room_ticket: join a deal's waiting room, or read tickets, for one or more buyers
  of one deal in one call (a gate sends the joins, or the reads, of one deal made in
  one event-loop turn together: gate/room/wire.py). Each buyer is handled in turn,
  exactly as if each had a call of its own; the deal's state, the room's settings
  and the clock are read once per call (with the call itself, about a third of what
  a join cost Redis: docs/hotpath.md, lever 36).
  O(log n) per buyer in the number of tickets, no loop over tickets: a hash look-up
  and write, and at most one sorted-set rank (a first join in join order needs only
  ZCARD: it is last; a ticket read while nothing is available needs only ZSCORE).

  The ticket's state is derived here, never stored per ticket:
    admitted   the user holds an unspent, unexpired admission      (KEYS[4])
    waiting    the user is in the queue and units are available    (KEYS[2])
    sold_out   the user is in the queue and available is 0: one deal-level fact
               (the mirror's counter), so every waiting ticket reads sold_out the
               moment the last unit is taken and waiting again when units return
    closed     the sale has ended, or the admission was spent or lapsed
  so selling out, units coming back and the sale ending cost no per-ticket work.

  Queue scores: the caller makes each new ticket's id (random, 128 bits) and its
  draw, the first 50 bits of HMAC-SHA256(seed, ticket_id). A buyer joining during
  the prequeue (before starts_at) gets the draw as score; so does every joiner of a
  "random" room; every later joiner of a "fifo" room gets 2^50 + a sequence number.
  Admission pops the lowest scores (room_advance.lua): at the opening the prequeue
  joiners go first in the draw's order, then FIFO (or, "random", all in the draw's
  order). A drawn ticket's id is appended to the draw list (KEYS[6]), which the
  fairness document reveals (gate/room/fairness.py).

  KEYS[1] room       hash   {d:ID}:room  on, aps, ttl_ms, pq_ms, method, msg, codes,
                                         pow_min, seed, seq, counters
  KEYS[2] queue      zset   {d:ID}:rq    user -> score (waiting tickets)
  KEYS[3] tickets    hash   {d:ID}:rt    user -> "joined_ms|next_poll_ms|ticket_id"
                                         (every ticket)
  KEYS[4] admitted   hash   {d:ID}:ra    user -> "seq|admitted_ms|expires_ms"
  KEYS[5] meta       hash   {d:ID}:meta  nb, avail, start_ms, end_ms, paused (the
                                         mirror's)
  KEYS[6] draw       list   {d:ID}:room:draw  ticket ids drawn, in join order
  KEYS[7] codes      hash   {d:ID}:rcodes  code HMAC -> "" (unbound) | user id
  KEYS[8] left       hash   {d:ID}:rleft   user -> next_poll_ms of the ticket they left
                                         (lua/room_leave.lua)
  (and, in the deal's slot, strings named after KEYS[1] with a TTL: the challenges
  spent, KEYS[1] .. ":pow:" .. id, and the failed code attempts' cells,
  KEYS[1] .. ":ca:u:" .. user id and KEYS[1] .. ":ca:i:" .. client address)

  ARGV[1] "join" | "read"
  ARGV[2] poll_after_ms floor      ARGV[3] poll_after_ms ceiling
  ARGV[4] failed code attempts allowed per minute, per buyer and per address
  then, per buyer (at least one):
    join: user id, the draw in [0, 2^50), the new ticket's id (both used only
          when the buyer has no ticket; an empty id: the caller lacks the room's
          seed, answered NOT_LOADED so that it loads the room), the access code's
          HMAC or "", the verified challenge "<id>|<expires_ms>" or "" (the gate
          checked its signature, buyer, deal, expiry and solution: gate/room/gates.py),
          the client address (used only with a code)
    read: user id
  (The caller packs ARGV[1..4] once per deal: they come first.)

  Returns one reply per buyer, in order, each
    {code, created, position, joined_ms, avail, admission seq, expires_ms,
     poll_after_ms, aps, ms until the sale starts, ticket_id, message JSON or "",
     paused: 1 while the sale is paused (gate/inventory/pause.py), else 0}
  (position, seq and expires_ms 0 when they do not apply), or {code} for a refusal
  (4-8, 10-14), or {9, wait ms}, or {16, wait ms}.
    0 WAITING  1 ADMITTED  2 SOLD_OUT  3 CLOSED   (the ticket's state)
    4 NOT_LOADED     the deal's state is absent; load it from the database
    5 NO_ROOM        the deal has no waiting room
    6 NO_TICKET      read: the user holds no ticket
    7 EARLY          join: before starts_at - prequeue
    8 ENDED          join: the sale has ended (an existing ticket reads closed)
    9 POLL_TOO_SOON  read: sooner than the last answer advised; {9, wait ms}
                     (also a join of a buyer who left, sooner than the left
                     ticket's next poll)
   10 ACCESS_CODE_REQUIRED  join, room "codes": no code     11 ACCESS_CODE_INVALID
   12 ACCESS_CODE_USED      the code is bound to another buyer
   13 CHALLENGE_REQUIRED    join, room with a challenge: none  14 CHALLENGE_INVALID (spent)
   16 CODE_ATTEMPTS_LIMITED join with a code: the buyer or the address failed too
                            many codes lately; {16, wait ms}
  A join's gates are judged only for a buyer without a ticket (a ticket holder's
  join is answered with the ticket, as a read: nothing judged, bound or spent), after
  the refusals that write nothing (7, 8), the proof of work first: so without a
  solved challenge, where the room asks one, every code is answered alike. A code
  refused (11, 12) counts as a failed attempt of the buyer and of the address (GCRA
  cells, as lua/limit.lua: `ARGV[4]` at once, then one per 60000 / ARGV[4] ms) and
  spends the challenge, so each guess costs a proof of work; a refusal before the
  code is judged writes nothing. The code is bound to the buyer and the challenge
  spent when the join is answered with a new ticket.
  A buyer who left the room (KEYS[8]) and joins again gets a new ticket at the back:
  never drawn (2^50 + a sequence number, whatever the method or the prequeue: behind
  every drawn ticket, so leaving cannot draw again), no sooner than the left ticket's
  next poll ({9, wait ms}), with the challenge judged as for anyone but no access code
  judged or bound (the buyer was let in once; a code bound to them stays theirs).
  A read (or a repeated join) records when the next one is welcome: polling
  faster than poll_after_ms advises (less 20 % for jitter) is refused.
]]
local OPEN_BASE = 1125899906842624  -- 2^50

local join = ARGV[1] == 'join'
local step = 1
if join then step = 6 end
local count = (#ARGV - 4) / step
local out = {}

local function all(reply)
  for i = 1, count do out[i] = reply end
  return out
end

local meta = redis.call('HMGET', KEYS[5], 'nb', 'avail', 'start_ms', 'end_ms', 'paused')
if not meta[1] then
  return all({4})
end
local cfg = redis.call('HMGET', KEYS[1], 'on', 'aps', 'pq_ms', 'method', 'msg', 'codes',
  'pow_min')
if cfg[1] ~= '1' then
  return all({5})
end
local random = cfg[4] == 'random'
local message = cfg[5] or ''
local aps = tonumber(cfg[2]) or 1
local avail = tonumber(meta[2]) or 0
if avail < 0 then avail = 0 end
local start_ms = tonumber(meta[3]) or 0
local end_ms = tonumber(meta[4]) or 0
local paused = meta[5] == '1' and 1 or 0

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ended = end_ms > 0 and now_ms >= end_ms
local to_start = 0
if start_ms > now_ms then to_start = start_ms - now_ms end
local prequeue = start_ms > 0 and now_ms < start_ms
local floor_ms, ceil_ms = tonumber(ARGV[2]), tonumber(ARGV[3])

local need_code = cfg[6] == '1'
local need_pow = cfg[7] ~= false

-- Failed code attempts: one GCRA cell per buyer and per address (ms of Redis time).
local attempts = tonumber(ARGV[4]) or 10
local interval = math.floor(60000 / attempts)
local function cell(kind, who)
  return KEYS[1] .. ':ca:' .. kind .. ':' .. who
end
local function arrival(key)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now_ms then tat = now_ms end
  return tat
end
local function charge(key, tat)
  tat = tat + interval
  redis.call('SET', key, tat, 'PX', tat - now_ms + 1000)
end

local function spend(pow)
  local id, expires = string.match(pow, '^(%x+)|(%d+)$')
  local ttl = math.max(60000, tonumber(expires) - now_ms + 60000)
  redis.call('SET', KEYS[1] .. ':pow:' .. id, '1', 'PX', ttl)
end

-- A new ticket's gates: nil when the buyer may go on, else the refusal.
local function gates(user, code, pow, address, rejoin)
  if need_pow then
    if pow == '' then return {13} end
    local id = string.match(pow, '^(%x+)|%d+$')
    if not id or redis.call('EXISTS', KEYS[1] .. ':pow:' .. id) == 1 then return {14} end
  end
  if need_code and not rejoin then
    if code == '' then return {10} end
    local ukey, akey = cell('u', user), cell('i', address)
    local utat, atat = arrival(ukey), arrival(akey)
    local wait = math.max(utat, atat) + interval - attempts * interval - now_ms
    if wait > 0 then return {16, wait} end
    local bound = redis.call('HGET', KEYS[7], code)
    if not bound or (bound ~= '' and bound ~= user) then
      charge(ukey, utat)
      charge(akey, atat)
      if need_pow then spend(pow) end
      if not bound then return {11} end
      return {12}
    end
  end
  return nil
end

-- The join got its new ticket: the code is the buyer's, the challenge spent (kept a
-- minute past its expiry, against gates whose clocks run behind).
local function pass(user, code, pow, rejoin)
  if need_code and not rejoin then
    redis.call('HSET', KEYS[7], code, user)
  end
  if need_pow then spend(pow) end
end

-- One buyer's join or read. Its writes are made before the next buyer's look-ups,
-- so a buyer named twice in one call is answered as two calls one after the other.
-- (`access` and `proof`: the buyer's code hash and challenge; `code` is the state.)
local function ticket(user, drawn, ticket_id, access, proof, address)
  local record = redis.call('HGET', KEYS[3], user)
  local created = 0
  local joined_ms, id
  local rejoin, drawn_now = false, false
  -- The ticket's state: CLOSED unless found otherwise below.
  local code, position, seq, expires, advice = 3, 0, 0, 0, ceil_ms
  if not record then
    if not join then
      return {6}
    end
    if ended then
      return {8}
    end
    if ticket_id == '' then
      return {4}
    end
    if prequeue and now_ms < start_ms - tonumber(cfg[3] or 0) then
      return {7}
    end
    -- leave: a buyer who left queues again at the back (see the header).
    local left = redis.call('HGET', KEYS[8], user)
    if left then
      rejoin = true
      if tonumber(left) > now_ms then return {9, tonumber(left) - now_ms} end
    end
    local refused = gates(user, access, proof, address, rejoin)
    if refused then return refused end
    local score
    drawn_now = (prequeue or random) and not rejoin
    if drawn_now then
      score = tonumber(drawn)
      redis.call('RPUSH', KEYS[6], ticket_id)
    else
      score = OPEN_BASE + redis.call('HINCRBY', KEYS[1], 'seq', 1)
    end
    redis.call('ZADD', KEYS[2], score, user)
    joined_ms, id = now_ms, ticket_id
    created = 1
    -- A new ticket is waiting (never admitted yet). Not drawn, it is the last one.
    if avail == 0 then
      code = 2
    elseif drawn_now then
      code, position = 0, redis.call('ZRANK', KEYS[2], user) + 1
    else
      code, position = 0, redis.call('ZCARD', KEYS[2])
    end
  else
    local next_poll
    joined_ms, next_poll, id = string.match(record, '^(%d+)|(%d+)|?(%x*)$')
    joined_ms = tonumber(joined_ms)
    if tonumber(next_poll) > now_ms then
      return {9, tonumber(next_poll) - now_ms}
    end
    if not ended then
      -- In the queue (waiting or sold out) or not; a queued ticket is never admitted
      -- (room_advance.lua pops it first), so the admissions are read only for the rest.
      if avail == 0 then
        if redis.call('ZSCORE', KEYS[2], user) then
          code = 2
        end
      else
        local rank = redis.call('ZRANK', KEYS[2], user)
        if rank then
          code, position = 0, rank + 1
        end
      end
      if code == 3 then
        local held = redis.call('HGET', KEYS[4], user)
        if held then
          local s, e = string.match(held, '^(%d+)|%d+|(%d+)$')
          if tonumber(e) > now_ms then
            -- Admitted buyers (a few: at most the units left) may look again soon.
            code, seq, expires, advice = 1, tonumber(s), tonumber(e), floor_ms
          end
        end
      end
    end
  end

  if code == 0 then
    local eta_ms = to_start + math.ceil(position * 1000 / aps)
    advice = math.min(ceil_ms, math.max(floor_ms, math.floor(eta_ms / 2)))
  end
  -- Sold out: units may come back (a hold expires, a cancel), worth a slow poll.

  if created == 1 then pass(user, access, proof, rejoin) end
  redis.call('HSET', KEYS[3], user,
    joined_ms .. '|' .. (now_ms + math.floor(advice * 0.8)) .. '|' .. id)
  return {code, created, position, joined_ms, avail, seq, expires, advice, aps, to_start,
    id, message, paused}
end

for i = 1, count do
  local at = 5 + (i - 1) * step
  out[i] = ticket(ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4],
    ARGV[at + 5])
end
return out
