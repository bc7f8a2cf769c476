-- wrk script: waiting-room requests (join or poll) by many buyers (loadtest/bench_room.py).
--
-- wrk -t T -c C -d D -s room.lua URL -- TOKENS METHOD PATH THREADS
--   TOKENS    file of "user_id token" lines (minted by the runner: wrk cannot sign)
--   METHOD    POST (join) or GET (poll)
--   PATH      /v1/deals/<id>/queue
--   THREADS   the -t value: each thread cycles through its own slice of the buyers,
--             so that a run shorter than one cycle joins every buyer at most once
-- Prints one line "WRKJSON {…}" with the answers by status and latency percentiles (µs),
-- the same shape as reserve.lua's.

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

counts = {}
sent = 0

local tokens = {}
local idx = 0
local method, path

function init(args)
  local file, nthreads = args[1], tonumber(args[4]) or 1
  method, path = args[2], args[3]
  local n = 0
  for line in io.lines(file) do
    if n % nthreads == id then
      local sp = line:find(" ", 1, true)
      tokens[#tokens + 1] = "Bearer " .. line:sub(sp + 1)
    end
    n = n + 1
  end
end

function request()
  idx = idx + 1
  if idx > #tokens then idx = 1 end
  sent = sent + 1
  return wrk.format(method, path, { ["Authorization"] = tokens[idx] })
end

function response(status, headers, rbody)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  local n_sent = 0
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("counts") or {}) do total[k] = (total[k] or 0) + v end
    n_sent = n_sent + (t:get("sent") or 0)
  end
  local parts = {}
  for k, v in pairs(total) do parts[#parts + 1] = string.format('"%d": %d', k, v) end
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "sent": %d, "fillers": 0, '
      .. '"errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d, "status": %d}, '
      .. '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}, '
      .. '"status": {%s}}\n',
    summary.requests, summary.duration, n_sent,
    summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.timeout, summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean, table.concat(parts, ", ")))
end
