-- Routine gate_expire_scratch (introduced by 004_expiry.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- The expiry sweeper's batch release (docs/expiry.md): set-based statements, so the
-- server's work grows linearly with the batch.

DELIMITER $$

-- The session's scratch table for gate_expire_batch, created on first use and
-- emptied before each batch. A temporary table is private to the connection and
-- never replicated as data.
CREATE OR REPLACE PROCEDURE gate_expire_scratch()
SQL SECURITY INVOKER
BEGIN
    DECLARE v_heap BIGINT UNSIGNED DEFAULT @@SESSION.max_heap_table_size;
    -- Already there: nothing to create (the handled error leaves no warning).
    DECLARE CONTINUE HANDLER FOR 1050 BEGIN END;
    -- A MEMORY table's capacity is fixed when it is created: room for the largest
    -- batch (5,000 orders) of many-part allocations, without raising the session's
    -- limit for anything else.
    SET SESSION max_heap_table_size = 268435456;
    CREATE TEMPORARY TABLE gate_expire_parts (
        order_id    CHAR(26) CHARACTER SET ascii NOT NULL,
        op_id       CHAR(26) CHARACTER SET ascii NOT NULL,
        part_no     INT UNSIGNED NOT NULL,
        deal_id     BIGINT UNSIGNED NOT NULL,
        user_id     BIGINT UNSIGNED NOT NULL,
        quantity    INT UNSIGNED NOT NULL,
        expires_at  DATETIME(6) NOT NULL,
        bucket      INT UNSIGNED NOT NULL,
        epoch       INT UNSIGNED NOT NULL,
        q           INT UNSIGNED NOT NULL,
        PRIMARY KEY (order_id, part_no)
    ) ENGINE = MEMORY;
    SET SESSION max_heap_table_size = v_heap;
    DELETE FROM gate_expire_parts;
END$$

DELIMITER ;
