--[[
  queue_take: a consumer takes one queued request for a commit attempt. After this
  the buyer's cancel is refused (409) until the attempt is over, so a cancel never
  gives back units a commit is taking.

  KEYS[1] status  string {d:ID}:q:o:TOKEN

  ARGV[1] status TTL (ms)

  Returns {code, detail, attempts}:
    0 TAKE      detail = enqueue time (ms); attempts = this attempt's number (1, 2…)
    1 FINAL     detail = "X|REASON": rejected or cancelled; the consumer only makes
                sure the units went back and acknowledges the entry
    2 UNKNOWN   no status (expired): the consumer decides from the database
]]
local st = redis.call('GET', KEYS[1])
if not st then
  return {2, '', 0}
end
local kind, ms, attempts = string.match(st, '^(%a)|([^|]*)|?(%d*)$')
if kind == 'X' then
  return {1, st, 0}
end
local n = (tonumber(attempts) or 0) + 1
redis.call('SET', KEYS[1], 'C|' .. ms .. '|' .. n, 'PX', ARGV[1])
return {0, ms, n}
