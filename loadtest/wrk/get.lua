-- wrk script: GET PATH with the same per-response accounting as reserve.lua, so the
-- two runs of a ratio pay the same client-side cost.
--   wrk -t T -c C -d D -s get.lua URL -- PATH

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

counts = {}
local path

function init(args)
  path = args[1] or "/healthz"
end

function request()
  return wrk.format("GET", path)
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("counts") or {}) do total[k] = (total[k] or 0) + v end
  end
  local parts = {}
  for k, v in pairs(total) do parts[#parts + 1] = string.format('"%d": %d', k, v) end
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "sent": %d, "fillers": 0, '
      .. '"errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d, "status": %d}, '
      .. '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}, '
      .. '"status": {%s}}\n',
    summary.requests, summary.duration, summary.requests,
    summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.timeout, summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean, table.concat(parts, ", ")))
end
