--[[
  queue_index: remember which deal (and buyer) a queued order belongs to, so that
  GET /v1/orders/{id} finds its status in the deal's slot. Sent in the same pipeline
  as, and just before, enqueue.lua (gate/queue/service.py): one round trip for both.

  KEYS[1] index   string gate:q:i:TOKEN

  ARGV[1] "deal id|user id"
  ARGV[2] TTL (ms)

  Returns 1.
]]
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
