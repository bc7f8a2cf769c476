-- Gate deals, version 20: the waiting room's configuration (docs/waiting-room.md).
--
-- NULL: the deal has no waiting room. Otherwise the compact JSON object the admin
-- API accepts, {"admit_per_second": n, "admission_ttl_seconds": n,
-- "prequeue_seconds": n}, validated by the gate before it is written. The room's
-- live state (tickets, admissions, counters) lives in Redis only; this column is
-- what a Redis flush cannot take away.

ALTER TABLE deals ADD COLUMN waiting_room VARCHAR(200) CHARACTER SET ascii NULL;
