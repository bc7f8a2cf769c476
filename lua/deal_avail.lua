--[[
  deal_avail: the units a loaded deal (or one partition of it) has left by Redis's
  count, for the buyer's deal view (GET /v1/deals/{id}: `remaining_hint`,
  gate/inventory/mirror.py `available`). Read-only. A script call rather than a plain HGET so
  that a crowd refreshing the deal's page goes through the gate's script runner (one
  pipelined write per loop turn, raw RESP): a redis-py command cost the gate more
  than the rest of the view (docs/hotpath.md lever 55).

  KEYS[1] meta   hash   {d:ID}:meta (or {d:ID:p:N}:meta)  avail

  Returns avail, or false when the deal (partition) is not loaded.
]]
return redis.call('HGET', KEYS[1], 'avail')
