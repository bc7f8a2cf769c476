-- Gate, version 65: the access codes of invite-only waiting rooms
-- (docs/waiting-room.md "Invite-only presales").
--
-- Redis holds a deal's codes for the joins ({d:ID}:rcodes); this table is their
-- home, so a Redis flush or a lost Redis does not lose a presale's invitations:
-- the room's load copies them back (gate/room/service.py load_codes). Only the
-- HMAC of each code is kept (GATE_ADMISSION_SECRET): the table gives no usable code.
-- The binding of a code to its first buyer lives in Redis only (a join writes no
-- database row), like the tickets.

CREATE TABLE IF NOT EXISTS room_access_codes (
    deal_id    BIGINT UNSIGNED NOT NULL,
    code_hash  CHAR(32) CHARACTER SET ascii NOT NULL,
    created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (deal_id, code_hash)
) ENGINE=InnoDB;
