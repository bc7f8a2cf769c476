-- Routine gate_cb_scratch (introduced by 005_callbacks.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Payment callbacks applied one at a time or in groups (docs/benchmarks-callbacks.md);
-- the event logic itself is gate_payment_event_in_tx (its codes are listed there).

DELIMITER $$

-- The session's scratch tables for gate_payment_event_group, created on first use
-- and emptied before each group. Temporary tables are private to the connection.
CREATE OR REPLACE PROCEDURE gate_cb_scratch()
SQL SECURITY INVOKER
BEGIN
    -- The provider's ids (event, payment, refund) take ascii_bin, as the tables'
    -- columns do since 007_binary_ids.sql: ids differing only by case stay distinct
    -- within a group too.
    -- Already there: nothing to create (the handled error leaves no warning).
    DECLARE CONTINUE HANDLER FOR 1050 BEGIN END;
    CREATE TEMPORARY TABLE gate_cb_events (
        n           INT UNSIGNED NOT NULL,
        event_id    VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
        event_type  VARCHAR(64) CHARACTER SET ascii NULL,
        order_id    CHAR(26) CHARACTER SET ascii NULL,
        payment_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
        amount      BIGINT UNSIGNED NULL,
        currency    CHAR(3) CHARACTER SET ascii NULL,
        refund_id   VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
        payload     MEDIUMTEXT CHARACTER SET utf8mb4 NULL,
        created     DATETIME(6) NULL,
        tx_id       CHAR(26) CHARACTER SET ascii NULL,
        fast        TINYINT NOT NULL DEFAULT 0,
        checked     TINYINT NOT NULL DEFAULT 0,
        deal_id     BIGINT UNSIGNED NULL,
        user_id     BIGINT UNSIGNED NULL,
        quantity    INT UNSIGNED NULL,
        alloc       VARCHAR(255) CHARACTER SET ascii NULL,
        code        INT NULL,
        outcome     VARCHAR(32) CHARACTER SET ascii NULL,
        detail      VARCHAR(64) CHARACTER SET ascii NULL,
        status      VARCHAR(20) CHARACTER SET ascii NULL,
        waiting     INT NOT NULL DEFAULT 0,
        capture     INT NOT NULL DEFAULT 0,
        PRIMARY KEY (n)
    ) ENGINE = InnoDB;
    CREATE TEMPORARY TABLE gate_cb_parts (
        n        INT UNSIGNED NOT NULL,
        part_no  INT UNSIGNED NOT NULL,
        deal_id  BIGINT UNSIGNED NOT NULL,
        bucket   INT UNSIGNED NOT NULL,
        epoch    INT UNSIGNED NOT NULL,
        q        INT UNSIGNED NOT NULL,
        PRIMARY KEY (n, part_no)
    ) ENGINE = InnoDB;
    DELETE FROM gate_cb_events;
    DELETE FROM gate_cb_parts;
END$$

DELIMITER ;
