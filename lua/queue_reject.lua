--[[
  queue_reject: a consumer rejects a queued request (the database refused it, or it
  is a dead letter), only if its own commit attempt still owns the request: a
  consumer that stalled while another took its entry over (its lease lapsed) must
  not give back units the other may be committing. After code 0 or 1 the caller
  gives the units back (compensate.lua, which acts once) and acknowledges the entry.

  KEYS[1] status  string {d:ID}:q:o:TOKEN

  ARGV[1] the caller's attempt number (queue_take.lua's answer)
  ARGV[2] reason (problem code, DEAD_LETTER)
  ARGV[3] status TTL (ms)

  Returns {code, detail}:
    0 REJECTED   the status is now "X|REASON" (also when it had expired)
    1 FINAL      detail = "X|…": rejected or cancelled before
    2 TAKEN      detail = the status: another attempt owns the request (nothing done)
]]
local st = redis.call('GET', KEYS[1])
if st then
  local kind, n = string.match(st, '^(%a)|[^|]*|?(%d*)$')
  if kind == 'X' then
    return {1, st}
  end
  if kind ~= 'C' or n ~= ARGV[1] then
    return {2, st}
  end
end
redis.call('SET', KEYS[1], 'X|' .. ARGV[2], 'PX', ARGV[3])
return {0, ''}
