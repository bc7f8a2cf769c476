--[[
  limit: one GCRA rate limiter whose key lives outside any deal's slot (the global
  limit of the reservation endpoint). Sent in the same pipeline as the admission,
  so it costs no extra round trip on a standalone Redis; judged by Redis TIME, so
  it is exact across gate processes.

  KEYS[1] limiter  string  theoretical arrival time (ms)

  ARGV[1] emission interval (ms, >= 1)
  ARGV[2] burst (>= 1)

  Returns {code, detail}:
    0 OK            detail = requests still allowed right now
    1 RATE_LIMITED  detail = retry after (ms)
]]
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now_ms then tat = now_ms end
local new_tat = tat + interval
local wait = new_tat - burst * interval - now_ms
if wait > 0 then
  return {1, wait}
end
redis.call('SET', KEYS[1], new_tat, 'PX', new_tat - now_ms + 1000)
return {0, math.floor((burst * interval - (new_tat - now_ms)) / interval)}
