-- Routine gate_reserve_scratch (introduced by 006_reserve_groups.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- The session's scratch table gate_rg_items for gate_reserve_group's items (group
-- commit, docs/reservation-groups.md), created on first use and emptied before each
-- group. Temporary tables are private to the connection. No result set.

DELIMITER $$

CREATE OR REPLACE PROCEDURE gate_reserve_scratch()
SQL SECURITY INVOKER
BEGIN
    -- Already there: nothing to create (the handled error leaves no warning).
    DECLARE CONTINUE HANDLER FOR 1050 BEGIN END;
    CREATE TEMPORARY TABLE gate_rg_items (
        n                INT UNSIGNED NOT NULL,
        order_id         CHAR(26) CHARACTER SET ascii NULL,
        user_id          BIGINT UNSIGNED NULL,
        quantity         INT UNSIGNED NULL,
        bucket           INT UNSIGNED NULL,
        idempotency_key  VARCHAR(255) CHARACTER SET ascii NULL,
        fingerprint      CHAR(32) CHARACTER SET ascii NULL,
        PRIMARY KEY (n)
    ) ENGINE = InnoDB;
    DELETE FROM gate_rg_items;
END$$

DELIMITER ;
