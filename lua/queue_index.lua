--[[
  queue_index: remember which deal (and buyer) a queued order belongs to, so that
  GET /v1/orders/{id} finds its status in the deal's slot. Sent in the same pipeline
  as, and just before, the admission that queues the request (lua/admit.lua's queue
  branch, or enqueue.lua): one round trip for both. An admission that queued nothing
  drops it again (ARGV[1] empty).

  KEYS[1] index   string gate:q:i:TOKEN

  ARGV[1] "deal id|user id", or "" to delete the index
  ARGV[2] TTL (ms)

  Returns 1.
]]
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
