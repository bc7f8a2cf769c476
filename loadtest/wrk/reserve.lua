-- wrk script: reservations against the gate or the baseline (same request shape).
--
-- wrk -t T -c C -d D -s reserve.lua URL -- TOKENS MODE PATH DELAY_MS TAG THREADS DONE_DIR
--   TOKENS    file of "user_id token" lines (minted by the runner: wrk cannot sign)
--   MODE      loop: cycle through the buyers, a fresh Idempotency-Key on every request
--             once: every buyer makes exactly one attempt (its own key); buyers are
--                   split across threads; a thread that has sent its share and seen
--                   every answer writes DONE_DIR/done.<id> (the runner then ends wrk)
--   PATH      /v1/deals/<id>/reservations
--   DELAY_MS  mean pause before each request, exponentially distributed (0: none);
--             sets the offered rate for the latency-at-load runs
--   TAG       unique per run, part of every Idempotency-Key
--   THREADS   the -t value (threads share nothing, so each needs to know its slice)
-- Prints one line "WRKJSON {…}" with the answers by status, latency percentiles (µs)
-- and the request count; filler requests (below) are excluded from the counts.

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

-- Globals: thread:get reads them from each thread's state in done().
counts = {}
fillers = 0
sent = 0
answered = 0

local tokens = {}
local idx = 0
local mode, path, delay_ms, tag
local body = '{"quantity": 1}'
local exhausted = false
local done_dir
local done_written = false
local primed = false

function init(args)
  local file, nthreads = args[1], tonumber(args[6]) or 1
  mode, path, delay_ms, tag, done_dir = args[2], args[3], tonumber(args[4]) or 0, args[5], args[7]
  local n = 0
  for line in io.lines(file) do
    if mode ~= "once" or n % nthreads == id then
      local sp = line:find(" ", 1, true)
      tokens[#tokens + 1] = { line:sub(1, sp - 1), "Bearer " .. line:sub(sp + 1) }
    end
    n = n + 1
  end
  math.randomseed(os.time() + id * 7919)
end

local function mark_done()
  if done_written or not done_dir then return end
  local f = io.open(done_dir .. "/done." .. id, "w")
  if f then f:write(sent, " ", answered, "\n"); f:close() end
  done_written = true
end

function request()
  -- wrk calls request() once on thread 0 before the run, only to see how many
  -- requests one call returns; that call must not use up a buyer.
  if not primed then
    primed = true
    if id == 0 then return wrk.format("GET", "/healthz") end
  end
  idx = idx + 1
  if idx > #tokens then
    if mode == "once" then
      -- Every buyer has had its attempt. wrk cannot leave a connection idle, so it
      -- sends slow health checks until the last answers are in; they are not counted.
      exhausted = true
      if answered >= sent then mark_done() end
      return wrk.format("GET", "/healthz")
    end
    idx = 1
  end
  local t = tokens[idx]
  sent = sent + 1
  return wrk.format("POST", path, {
    ["Authorization"] = t[2],
    ["Idempotency-Key"] = string.format("%s-%d-%09d", tag, id, sent),
    ["Content-Type"] = "application/json",
  }, body)
end

function delay()
  if exhausted then return 50 end
  if delay_ms > 0 then return -math.log(1 - math.random()) * delay_ms end
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
