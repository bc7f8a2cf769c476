-- wrk script: pre-signed payment callbacks, each sent exactly once.
--
-- wrk -t T -c C -d D -s callbacks.lua URL -- FILE PATH THREADS DONE_DIR
--   FILE      one callback per line: "webhook-id<TAB>webhook-timestamp<TAB>signature<TAB>body"
--             (signed by the runner just before wrk starts: wrk cannot compute HMACs,
--             and the ±300 s window leaves ample time)
--   PATH      /v1/payments/<provider>/webhook
--   THREADS   the -t value (line n goes to thread n mod THREADS)
--   DONE_DIR  a thread that has sent its share and seen every answer writes
--             DONE_DIR/done.<id>; the runner then interrupts wrk
-- Prints one line "WRKJSON {…}" (same shape as reserve.lua): answers by status, latency
-- percentiles (µs) and the request count; filler health checks are not counted.

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

counts = {}
fillers = 0
sent = 0
answered = 0

local lines = {}
local idx = 0
local path, done_dir
local exhausted = false
local done_written = false
local primed = false

function init(args)
  local file, nthreads = args[1], tonumber(args[3]) or 1
  path, done_dir = args[2], args[4]
  local n = 0
  for line in io.lines(file) do
    if n % nthreads == id then
      local a = line:find("\t", 1, true)
      local b = line:find("\t", a + 1, true)
      local c = line:find("\t", b + 1, true)
      lines[#lines + 1] = {
        line:sub(1, a - 1), line:sub(a + 1, b - 1), line:sub(b + 1, c - 1), line:sub(c + 1),
      }
    end
    n = n + 1
  end
end

local function mark_done()
  if done_written or not done_dir then return end
  local f = io.open(done_dir .. "/done." .. id, "w")
  if f then f:write(sent, " ", answered, "\n"); f:close() end
  done_written = true
end

function request()
  -- wrk calls request() once on thread 0 before the run only to size its buffers;
  -- that call must not use up a callback.
  if not primed then
    primed = true
    if id == 0 then return wrk.format("GET", "/healthz") end
  end
  idx = idx + 1
  if idx > #lines then
    exhausted = true
    if answered >= sent then mark_done() end
    return wrk.format("GET", "/healthz")
  end
  local l = lines[idx]
  sent = sent + 1
  return wrk.format("POST", path, {
    ["webhook-id"] = l[1],
    ["webhook-timestamp"] = l[2],
    ["webhook-signature"] = l[3],
    ["Content-Type"] = "application/json",
  }, l[4])
end

function delay()
  if exhausted then return 50 end
  return 0
end

function response(status, headers, rbody)
  if exhausted and status == 200 and rbody:find('"status":"ok"', 1, true) then
    fillers = fillers + 1
  else
    answered = answered + 1
    counts[status] = (counts[status] or 0) + 1
  end
  if exhausted and answered >= sent then mark_done() end
end

function done(summary, latency, requests)
  local total = {}
  local n_fill, n_sent = 0, 0
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("counts") or {}) do total[k] = (total[k] or 0) + v end
    n_fill = n_fill + (t:get("fillers") or 0)
    n_sent = n_sent + (t:get("sent") or 0)
  end
  local parts = {}
  for k, v in pairs(total) do parts[#parts + 1] = string.format('"%d": %d', k, v) end
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "sent": %d, "fillers": %d, '
      .. '"errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d, "status": %d}, '
      .. '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}, '
      .. '"status": {%s}}\n',
    summary.requests, summary.duration, n_sent, n_fill,
    summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.timeout, summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean, table.concat(parts, ", ")))
end
