--[[
  outbox_publish: append one batch of outbox rows to the event stream, in order,
  in one call (the outbox relay, gate/payments/outbox.py). A pipeline of one XADD
  per row cost the relay about four times as much CPU per event in the gate
  (docs/expiry.md, "Speed"); the stream entries are the same.

  KEYS[1] stream          the event stream (GATE_OUTBOX_STREAM)

  ARGV[1] approximate maximum length of the stream (XADD MAXLEN ~)
  ARGV[2] N, then N groups of 5:
          event id, topic, aggregate id, payload (JSON text), created at (ISO 8601)

  Returns N, the number of entries appended. Delivery stays at least once: a relay
  that dies after this call and before marking its rows publishes them again with
  the same event ids.
]]
local n = tonumber(ARGV[2])
for i = 0, n - 1 do
  local b = 3 + i * 5
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*',
    'event_id', ARGV[b], 'topic', ARGV[b + 1], 'aggregate_id', ARGV[b + 2],
    'payload', ARGV[b + 3], 'created_at', ARGV[b + 4])
end
return n
