--[[
  room_state: a deal's waiting-room counters as `gate check` balances them
  (gate/inventory/room_check.py), read in one step: every room script changes them together.
  A script rather than MULTI for the reason lua/deal_state.lua gives.

  KEYS[1] room      hash   {d:ID}:room  on, admitted, spent, lapsed, …
  KEYS[2] admitted  hash   {d:ID}:ra    user -> unspent admission
  KEYS[3] expiry    zset   {d:ID}:rx    user -> admission expiry (ms)
  KEYS[4] queue     zset   {d:ID}:rq    user -> score (waiting tickets)
  KEYS[5] tickets   hash   {d:ID}:rt    user -> every ticket

  Returns {{on, admitted, spent, lapsed} (each false when absent), unspent admissions,
  indexed expiries, waiting tickets, tickets}.
]]
return {
  redis.call('HMGET', KEYS[1], 'on', 'admitted', 'spent', 'lapsed'),
  redis.call('HLEN', KEYS[2]),
  redis.call('ZCARD', KEYS[3]),
  redis.call('ZCARD', KEYS[4]),
  redis.call('HLEN', KEYS[5]),
}
