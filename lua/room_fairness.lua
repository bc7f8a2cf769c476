--[[
  room_fairness: what GET /v1/deals/{id}/queue/fairness shows, judged on Redis time
  (the clock the joins were judged by; gate/room/fairness.py).

  The draw is revealed
    fifo    at starts_at (no prequeue joins after it; a deal without starts_at has
            had no prequeue: revealed at once, with no participants)
    random  at ends_at (every joiner is drawn; a deal without ends_at: never)

  KEYS[1] room  hash  {d:ID}:room   on, method, seed
  KEYS[2] meta  hash  {d:ID}:meta   start_ms, end_ms (the mirror's)
  KEYS[3] draw  list  {d:ID}:room:draw

  Returns {code, method, seed hex, revealed (0|1), ids drawn, the last id drawn}
    code 0 OK   4 NOT_LOADED (no deal state)   5 NO_ROOM
  (method, seed, revealed, count and last id are the document's version: the gate
  encodes the document again only when one of them changed, gate/room/fairness_doc.py)
]]
local meta = redis.call('HMGET', KEYS[2], 'nb', 'start_ms', 'end_ms')
if not meta[1] then
  return {4, '', '', 0, 0, ''}
end
local cfg = redis.call('HMGET', KEYS[1], 'on', 'method', 'seed')
if cfg[1] ~= '1' then
  return {5, '', '', 0, 0, ''}
end
if not cfg[3] then
  -- Published by a gate that made no seed: load the room again (its seed with it).
  return {4, '', '', 0, 0, ''}
end
local method = cfg[2] or 'fifo'
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local start_ms = tonumber(meta[2]) or 0
local end_ms = tonumber(meta[3]) or 0
local revealed = 0
if method == 'random' then
  if end_ms > 0 and now_ms >= end_ms then revealed = 1 end
elseif start_ms <= 0 or now_ms >= start_ms then
  revealed = 1
end
return {0, method, cfg[3], revealed, redis.call('LLEN', KEYS[3]),
  redis.call('LINDEX', KEYS[3], -1) or ''}
