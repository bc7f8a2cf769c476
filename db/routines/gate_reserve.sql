-- Routine gate_reserve (introduced by 002_procedures.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Result codes (mirrored by gate.base.codes.DbCode):
--   0 OK, 1 SOLD_OUT, 2 LIMIT_EXCEEDED, 3 DUPLICATE, 4 NOT_FOUND, 5 NOT_ACTIVE,
--   6 BAD_QUANTITY, 7 WRONG_STATE.
-- A bucket row whose epoch no longer matches (the deal was rebucketed mid-flight)
-- raises errno 1213 so that the caller's deadlock retry runs the transaction again.
-- One whole short transaction in one client round trip: the hot bucket row is locked
-- only for the microseconds the server needs, never across a network hop.

DELIMITER $$

CREATE OR REPLACE PROCEDURE gate_reserve(
    IN p_order_id         CHAR(26) CHARACTER SET ascii,
    IN p_deal_id          BIGINT UNSIGNED,
    IN p_user_id          BIGINT UNSIGNED,
    IN p_quantity         INT UNSIGNED,
    IN p_alloc            VARCHAR(255) CHARACTER SET ascii,
    IN p_idempotency_key  VARCHAR(255) CHARACTER SET ascii,
    IN p_fingerprint      CHAR(32) CHARACTER SET ascii,
    IN p_actor            VARCHAR(64))
SQL SECURITY INVOKER
proc: BEGIN
    DECLARE v_found     INT DEFAULT 1;
    DECLARE v_price     BIGINT UNSIGNED;
    DECLARE v_currency  CHAR(3) CHARACTER SET ascii;
    DECLARE v_title     VARCHAR(200);
    DECLARE v_hold      INT UNSIGNED;
    DECLARE v_limit     INT UNSIGNED;
    DECLARE v_max       INT UNSIGNED;
    DECLARE v_nb        INT UNSIGNED;
    DECLARE v_epoch     INT UNSIGNED;
    DECLARE v_capture   VARCHAR(16) CHARACTER SET ascii;
    DECLARE v_starts    DATETIME(6);
    DECLARE v_ends      DATETIME(6);
    DECLARE v_now       DATETIME(6);
    DECLARE v_rest      VARCHAR(255) CHARACTER SET ascii DEFAULT p_alloc;
    DECLARE v_out       VARCHAR(255) CHARACTER SET ascii DEFAULT '';
    DECLARE v_part      VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_b         INT UNSIGNED;
    DECLARE v_q         BIGINT UNSIGNED;
    DECLARE v_avail     BIGINT UNSIGNED;
    DECLARE v_after     BIGINT UNSIGNED;
    DECLARE v_units     INT UNSIGNED;
    DECLARE v_deficit   BIGINT UNSIGNED DEFAULT 0;
    DECLARE v_tries     INT DEFAULT 0;
    -- Deal partitions (db/040_partitions.sql): the fall-over stays in the partition
    -- of the first bucket Redis chose (b MOD P), whose Redis state admitted the buyer.
    DECLARE v_parts     INT UNSIGNED DEFAULT 1;
    DECLARE v_home      INT UNSIGNED DEFAULT 0;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE EXIT HANDLER FOR 1062
    BEGIN
        ROLLBACK;
        SELECT 3 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
    END;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    SELECT unit_price, currency, title, hold_seconds, per_user_limit, max_per_order,
           bucket_count, layout_epoch, capture_mode, starts_at, ends_at, partitions
      INTO v_price, v_currency, v_title, v_hold, v_limit, v_max,
           v_nb, v_epoch, v_capture, v_starts, v_ends, v_parts
      FROM deals WHERE id = p_deal_id;
    IF v_found = 0 THEN
        SELECT 4 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
        LEAVE proc;
    END IF;
    SET v_now = NOW(6);
    IF (v_starts IS NOT NULL AND v_now < v_starts) OR (v_ends IS NOT NULL AND v_now >= v_ends) THEN
        SELECT 5 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
        LEAVE proc;
    END IF;
    IF p_quantity < 1 OR p_quantity > v_max THEN
        SELECT 6 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
        LEAVE proc;
    END IF;

    START TRANSACTION;

    -- Take each part of the allocation Redis chose, conditionally.
    WHILE v_rest <> '' DO
        SET v_part = SUBSTRING_INDEX(v_rest, ',', 1);
        SET v_rest = IF(LOCATE(',', v_rest) > 0, SUBSTRING(v_rest, LOCATE(',', v_rest) + 1), '');
        SET v_b = CAST(SUBSTRING_INDEX(v_part, ':', 1) AS UNSIGNED) MOD v_nb;
        SET v_q = CAST(SUBSTRING_INDEX(v_part, ':', -1) AS UNSIGNED);
        UPDATE deal_buckets
           SET available = available - v_q, held = held + v_q, updated_at = v_now
         WHERE deal_id = p_deal_id AND bucket = v_b AND epoch = v_epoch AND available >= v_q;
        IF ROW_COUNT() = 1 THEN
            SELECT available INTO v_after FROM deal_buckets
             WHERE deal_id = p_deal_id AND bucket = v_b;
            INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,
                d_available, d_held, d_sold, available_before, available_after, reason, actor,
                created_at)
            VALUES (p_deal_id, v_b, p_order_id, p_order_id, 0, -CAST(v_q AS SIGNED), v_q, 0,
                v_after + v_q, v_after, 'reserve', p_actor, v_now);
            SET v_out = IF(v_out = '', CONCAT(v_b, ':', v_q), CONCAT(v_out, ',', v_b, ':', v_q));
        ELSE
            SET v_deficit = v_deficit + v_q;
        END IF;
    END WHILE;

    -- Redis disagreed with the database (drift, or a rebucketing since Redis chose):
    -- the database is the truth, so fall over to whichever buckets still hold stock
    -- in the current layout. The caller moves Redis to match the allocation returned.
    IF v_deficit > 0 THEN
        SET v_found = 1;
        SELECT bucket_count, layout_epoch INTO v_nb, v_epoch FROM deals WHERE id = p_deal_id;
        SET v_home = (CAST(SUBSTRING_INDEX(p_alloc, ':', 1) AS UNSIGNED) MOD v_nb) MOD v_parts;
    END IF;
    WHILE v_deficit > 0 AND v_tries < 16 DO
        SET v_tries = v_tries + 1;
        SET v_found = 1;
        SELECT bucket, available INTO v_b, v_avail FROM deal_buckets
         WHERE deal_id = p_deal_id AND epoch = v_epoch AND available > 0
           AND (v_parts = 1 OR bucket MOD v_parts = v_home)
         ORDER BY available DESC LIMIT 1;
        IF v_found = 0 THEN
            SET v_tries = 16;
        ELSE
            SET v_q = LEAST(v_avail, v_deficit);
            UPDATE deal_buckets
               SET available = available - v_q, held = held + v_q, updated_at = v_now
             WHERE deal_id = p_deal_id AND bucket = v_b AND epoch = v_epoch AND available >= v_q;
            IF ROW_COUNT() = 1 THEN
                SELECT available INTO v_after FROM deal_buckets
                 WHERE deal_id = p_deal_id AND bucket = v_b;
                INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,
                    d_available, d_held, d_sold, available_before, available_after, reason,
                    actor, created_at)
                VALUES (p_deal_id, v_b, p_order_id, p_order_id, 0, -CAST(v_q AS SIGNED), v_q, 0,
                    v_after + v_q, v_after, 'reserve', p_actor, v_now);
                SET v_out = IF(v_out = '', CONCAT(v_b, ':', v_q), CONCAT(v_out, ',', v_b, ':', v_q));
                SET v_deficit = v_deficit - v_q;
            END IF;
        END IF;
    END WHILE;
    IF v_deficit > 0 THEN
        ROLLBACK;
        SELECT 1 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
        LEAVE proc;
    END IF;

    IF v_limit IS NOT NULL THEN
        INSERT INTO user_quota (deal_id, user_id, units) VALUES (p_deal_id, p_user_id, p_quantity)
            ON DUPLICATE KEY UPDATE units = units + p_quantity;
        SELECT units INTO v_units FROM user_quota WHERE deal_id = p_deal_id AND user_id = p_user_id;
        IF v_units > v_limit THEN
            ROLLBACK;
            SELECT 2 AS code, '' AS alloc, NULL AS expires_at, NULL AS created_at;
            LEAVE proc;
        END IF;
    END IF;

    SET v_now = NOW(6);
    INSERT INTO orders (id, deal_id, user_id, quantity, unit_price, amount, currency, title,
        status, alloc, idempotency_key, request_fingerprint, capture_mode, expires_at,
        created_at, updated_at)
    VALUES (p_order_id, p_deal_id, p_user_id, p_quantity, v_price, v_price * p_quantity,
        v_currency, v_title, 'PENDING_PAYMENT', v_out, p_idempotency_key, p_fingerprint,
        v_capture, v_now + INTERVAL v_hold SECOND, v_now, v_now);
    COMMIT;
    SELECT 0 AS code, v_out AS alloc, v_now + INTERVAL v_hold SECOND AS expires_at,
           v_now AS created_at, v_price AS unit_price, v_currency AS currency;
END$$

DELIMITER ;
