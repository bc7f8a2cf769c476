--[[
  room_leave: a buyer leaves a deal's waiting room (DELETE /v1/deals/{id}/queue,
  gate/room/leave.py). One call, atomic, O(log n) in the number of tickets.

    waiting or sold out (in the queue) ──> the queue entry and the ticket deleted:
                                          everyone behind moves up one place
    admitted (an unspent, unexpired admission) ──> the admission given back (its slot
                                          returns to the room's bound at once, counted
                                          as lapsed: an admission that became no hold)
                                          and the ticket deleted
    then the buyer is recorded as having left (KEYS[7]): a later join of theirs is a
    new ticket at the back (lua/room_ticket.lua), welcome no sooner than the left
    ticket's next poll, and binds no further access code. A code bound to them
    stays theirs (docs/waiting-room.md, "Leaving the line").
    no ticket, but left before ──> nothing to do (a repeated leave: idempotent)
    no ticket, never left, or a closed ticket (its admission spent or lapsed, or the
    sale ended) ──> NOT_IN_QUEUE, nothing written: a buyer who bought, or let an
    admission lapse, cannot leave to queue again.

  KEYS[1] room       hash   {d:ID}:room   on, lapsed (the counters gate check balances)
  KEYS[2] queue      zset   {d:ID}:rq     user -> score (waiting tickets)
  KEYS[3] tickets    hash   {d:ID}:rt     user -> "joined_ms|next_poll_ms|ticket_id"
  KEYS[4] admitted   hash   {d:ID}:ra     user -> "seq|admitted_ms|expires_ms"
  KEYS[5] expiry     zset   {d:ID}:rx     user -> expires_ms
  KEYS[6] meta       hash   {d:ID}:meta   nb, end_ms (the mirror's)
  KEYS[7] left       hash   {d:ID}:rleft  user -> the left ticket's next_poll_ms

  ARGV[1] user id

  Returns {code, given back}
    {0, 0}  left: the ticket was in the queue
    {0, 1}  left: the ticket was admitted; its admission given back
    {1, 0}  had left already (no ticket now): nothing done
    {4}  NOT_LOADED    the deal's state is absent; load it from the database
    {5}  NO_ROOM       the deal has no waiting room
    {17} NOT_IN_QUEUE  no ticket (never joined), or a closed ticket (kept)
]]
local user = ARGV[1]
if not redis.call('HGET', KEYS[6], 'nb') then
  return {4}
end
if redis.call('HGET', KEYS[1], 'on') ~= '1' then
  return {5}
end
local record = redis.call('HGET', KEYS[3], user)
if not record then
  if redis.call('HEXISTS', KEYS[7], user) == 1 then
    return {1, 0}
  end
  return {17}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local end_ms = tonumber(redis.call('HGET', KEYS[6], 'end_ms')) or 0
if end_ms > 0 and now_ms >= end_ms then
  -- The ticket reads closed: nothing to leave.
  return {17}
end

local given = 0
-- A queued ticket is never admitted (room_advance.lua pops it first): one or the other.
if redis.call('ZREM', KEYS[2], user) == 0 then
  local held = redis.call('HGET', KEYS[4], user)
  local expires = held and tonumber(string.match(held, '^%d+|%d+|(%d+)$')) or 0
  if expires <= now_ms then
    -- Spent, lapsed or expiring: the ticket reads closed and stays.
    return {17}
  end
  redis.call('HDEL', KEYS[4], user)
  redis.call('ZREM', KEYS[5], user)
  redis.call('HINCRBY', KEYS[1], 'lapsed', 1)
  given = 1
end
redis.call('HDEL', KEYS[3], user)
local next_poll = string.match(record, '^%d+|(%d+)') or '0'
redis.call('HSET', KEYS[7], user, next_poll)
return {0, given}
