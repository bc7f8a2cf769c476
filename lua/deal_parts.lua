--[[
  deal_parts: how many partitions a loaded deal has (docs/scale-out.md, "Deal
  partitions"), read once per deal and process by the reservation path before it
  routes a buyer. A script call rather than a plain HMGET so that it travels in the
  hot path's pipeline (gate/store/scripts.py): a crowd's first requests for a deal must
  not each take a connection of a pool.

  KEYS[1] meta   hash   {d:ID}:meta  nb, pp (partition 0's meta holds pp when P > 1)

  Returns {nb, pp}: nb false when the deal is not loaded; pp false when the deal has
  one partition.
]]
return redis.call('HMGET', KEYS[1], 'nb', 'pp')
