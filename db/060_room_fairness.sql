-- Gate deals, version 60: the waiting room's draw seed and a longer configuration
-- (docs/waiting-room.md, "Verifiable draw" and "Message to waiters").
--
-- room_seed: 32 random bytes made the first time the deal gets a waiting room, never
-- changed after. Its SHA-256 is the room's published commitment; the seed orders the
-- prequeue draw (and every ticket of a "random" room) by HMAC-SHA256(seed, ticket_id).
-- Kept here so that a Redis flush cannot change it.
--
-- waiting_room grows to hold the message to waiters (up to 280 characters, stored
-- JSON-escaped to ASCII: at most 12 bytes a character, a
-- character outside the Basic Multilingual Plane being two escapes).

ALTER TABLE deals MODIFY COLUMN waiting_room VARCHAR(4096) CHARACTER SET ascii NULL;
ALTER TABLE deals ADD COLUMN IF NOT EXISTS room_seed BINARY(32) NULL AFTER waiting_room;
