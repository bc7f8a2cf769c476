--[[
  deal_state: one deal's (or one partition's) counters as `gate check` compares them
  with the database (gate/inventory/check.py), read in one step: every script that changes a
  bucket changes the in-flight hash in the same call, so the three reads agree.
  A script rather than MULTI: redis-py's asyncio cluster pipeline runs each queued
  command of a transaction through a thread and an event loop of its own, and on a
  client not yet initialized leaves its connections bound to that dead loop; a
  script call is routed by its keys' slot like any command, on one Redis or a cluster.

  KEYS[1] meta      hash   {d:ID}:meta  nb, avail, drift, …
  KEYS[2] buckets   hash   {d:ID}:b     bucket -> available units
  KEYS[3] inflight  hash   {d:ID}:f     token -> in-flight record

  Returns {meta as HGETALL's flat field/value list, buckets likewise, in-flight count};
  meta's list is empty when the deal is not loaded.
]]
return {
  redis.call('HGETALL', KEYS[1]),
  redis.call('HGETALL', KEYS[2]),
  redis.call('HLEN', KEYS[3]),
}
