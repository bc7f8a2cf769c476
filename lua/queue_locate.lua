--[[
  queue_locate: which deal (and buyer) a queued order belongs to, for
  GET /v1/orders/{id} (gate/queuemode/service.py `_locate`). Read-only. A script rather
  than a plain GET so that the read goes through the gate's script runner (raw RESP,
  routed by slot on a cluster) like the poll's second step, lua/queue_peek.lua: one
  redis-py command cost the gate about as much as the rest of the poll.

  KEYS[1] index   string gate:q:i:TOKEN   "deal id|user id" (lua/queue_index.lua)

  Returns the index's value, or false when there is none.
]]
return redis.call('GET', KEYS[1])
