--[[
  queue_peek: a queued order's state in its deal's slot, for GET /v1/orders/{id}
  (gate/queuemode/service.py `_locate`), in one step after lua/queue_locate.lua found the
  deal. Read-only.

  KEYS[1] status    string {d:ID}:q:o:TOKEN  "Q|…" waiting, "C|…" being committed,
                                             "X|REASON" rejected (final)
  KEYS[2] inflight  hash   {d:ID}:f          token -> "T|user|qty|…" (the
                                             request's units still in flight)

  ARGV[1] the order id (the in-flight token)

  Returns {status or false, in-flight record or false}. Both are read in the same
  step: a status "Q" or "C" with no record means the request left the queue between
  the two (committed or given back), which the caller reads from the database.
]]
return {
  redis.call('GET', KEYS[1]),
  redis.call('HGET', KEYS[2], ARGV[1]),
}
