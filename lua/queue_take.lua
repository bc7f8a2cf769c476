--[[
  queue_take: a consumer takes a batch of queued requests of one deal for a commit
  attempt (one call for the whole batch). After this each one's cancel is refused
  (503) until the attempt is over, so a cancel never gives back units a commit is
  taking.

  KEYS[1..n] status  string {d:ID}:q:o:TOKEN, one per request

  ARGV[1] status TTL (ms)

  Returns one {code, detail, attempts} per key, in order:
    0 TAKE      detail = enqueue time (ms); attempts = this attempt's number (1, 2…)
    1 FINAL     detail = "X|REASON": rejected or cancelled; the consumer only makes
                sure the units went back and acknowledges the entry
    2 UNKNOWN   no status (expired): the consumer decides from the database
]]
local out = {}
for i = 1, #KEYS do
  local st = redis.call('GET', KEYS[i])
  if not st then
    out[i] = {2, '', 0}
  else
    local kind, ms, attempts = string.match(st, '^(%a)|([^|]*)|?(%d*)$')
    if kind == 'X' then
      out[i] = {1, st, 0}
    else
      local n = (tonumber(attempts) or 0) + 1
      redis.call('SET', KEYS[i], 'C|' .. ms .. '|' .. n, 'PX', ARGV[1])
      out[i] = {0, ms, n}
    end
  end
end
return out
