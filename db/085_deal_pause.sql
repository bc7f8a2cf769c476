-- Gate deals, version 85: a deal's sale paused (docs/operations.md, "A sale that
-- stops itself").
--
-- The invariant monitor pauses a deal whose books it finds broken, an operator
-- pauses and resumes one by hand (gate deal pause / resume, the console). The pause
-- is durable here; Redis mirrors it into the deal's meta hash ("paused"), which the
-- admission script already reads, so a paused deal is refused in the same call.
-- NULL paused_at: the deal sells. resumed_at: the latest resume, so that a check whose
-- snapshot is older than it cannot pause the deal again with what it saw.

ALTER TABLE deals
  ADD COLUMN IF NOT EXISTS paused_at DATETIME(6) NULL AFTER room_logo,
  ADD COLUMN IF NOT EXISTS pause_reason VARCHAR(255) CHARACTER SET utf8mb4 NULL AFTER paused_at,
  ADD COLUMN IF NOT EXISTS resumed_at DATETIME(6) NULL AFTER pause_reason;
