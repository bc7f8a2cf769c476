-- Routine gate_release (introduced by 002_procedures.sql; kept once, here).
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

-- Move one holding order to a terminal state and give its stock back to the buckets
-- it came from, with ledger, quota and outbox rows, in one transaction. p_op_id is
-- the caller's Redis intent id; it marks the ledger rows and is the outbox event id.
--   p_to              'CANCELLED' or 'EXPIRED'
--   p_user_id         only this buyer's order (NULL: any)
--   p_due_only        1: only when expires_at <= NOW(6) (the database clock decides)
--   p_allow_authorized 1: an AUTHORIZED order may be released too
-- Returns code 0 with the order's deal, user, quantity and allocation, or 7
-- WRONG_STATE when the order is not (or no longer) in a releasable state.
CREATE OR REPLACE PROCEDURE gate_release(
    IN p_order_id          CHAR(26) CHARACTER SET ascii,
    IN p_to                VARCHAR(20) CHARACTER SET ascii,
    IN p_user_id           BIGINT UNSIGNED,
    IN p_due_only          TINYINT,
    IN p_allow_authorized  TINYINT,
    IN p_reason            VARCHAR(32) CHARACTER SET ascii,
    IN p_actor             VARCHAR(64),
    IN p_op_id             CHAR(26) CHARACTER SET ascii)
SQL SECURITY INVOKER
proc: BEGIN
    DECLARE v_found   INT DEFAULT 1;
    DECLARE v_deal    BIGINT UNSIGNED;
    DECLARE v_user    BIGINT UNSIGNED;
    DECLARE v_qty     INT UNSIGNED;
    DECLARE v_alloc   VARCHAR(255) CHARACTER SET ascii;
    DECLARE v_nb      INT UNSIGNED;
    DECLARE v_epoch   INT UNSIGNED;
    DECLARE v_rest    VARCHAR(255) CHARACTER SET ascii;
    DECLARE v_part    VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_b       INT UNSIGNED;
    DECLARE v_q       BIGINT UNSIGNED;
    DECLARE v_after   BIGINT UNSIGNED;
    DECLARE v_now     DATETIME(6);
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    START TRANSACTION;
    SET v_now = NOW(6);
    UPDATE orders
       SET status = p_to, closed_at = v_now, updated_at = v_now, version = version + 1
     WHERE id = p_order_id
       AND (status = 'PENDING_PAYMENT' OR (p_allow_authorized = 1 AND status = 'AUTHORIZED'))
       AND (p_user_id IS NULL OR user_id = p_user_id)
       AND (p_due_only = 0 OR expires_at <= v_now);
    IF ROW_COUNT() = 0 THEN
        ROLLBACK;
        SELECT 7 AS code, 0 AS deal_id, 0 AS user_id, 0 AS quantity, '' AS alloc;
        LEAVE proc;
    END IF;
    SELECT deal_id, user_id, quantity, alloc INTO v_deal, v_user, v_qty, v_alloc
      FROM orders WHERE id = p_order_id;
    SELECT bucket_count, layout_epoch INTO v_nb, v_epoch FROM deals WHERE id = v_deal;

    SET v_rest = v_alloc;
    WHILE v_rest <> '' DO
        SET v_part = SUBSTRING_INDEX(v_rest, ',', 1);
        SET v_rest = IF(LOCATE(',', v_rest) > 0, SUBSTRING(v_rest, LOCATE(',', v_rest) + 1), '');
        SET v_b = CAST(SUBSTRING_INDEX(v_part, ':', 1) AS UNSIGNED) MOD v_nb;
        SET v_q = CAST(SUBSTRING_INDEX(v_part, ':', -1) AS UNSIGNED);
        UPDATE deal_buckets
           SET available = available + v_q, held = held - v_q, updated_at = v_now
         WHERE deal_id = v_deal AND bucket = v_b AND epoch = v_epoch;
        IF ROW_COUNT() = 0 THEN
            SIGNAL SQLSTATE '40001'
                SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: bucket layout changed; retry';
        END IF;
        SELECT available INTO v_after FROM deal_buckets WHERE deal_id = v_deal AND bucket = v_b;
        INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total, d_available,
            d_held, d_sold, available_before, available_after, reason, actor, created_at)
        VALUES (v_deal, v_b, p_order_id, p_op_id, 0, v_q, -CAST(v_q AS SIGNED), 0,
            v_after - v_q, v_after, p_reason, p_actor, v_now);
    END WHILE;

    UPDATE user_quota SET units = units - v_qty
     WHERE deal_id = v_deal AND user_id = v_user AND units >= v_qty;
    INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at)
    VALUES (p_op_id, CONCAT('order.', LOWER(p_to)), p_order_id,
        -- "+ 0" makes MariaDB emit procedure variables as JSON numbers, not strings.
        JSON_OBJECT('order_id', p_order_id, 'deal_id', v_deal + 0, 'user_id', v_user + 0,
                    'quantity', v_qty + 0, 'status', p_to, 'reason', p_reason,
                    'at', DATE_FORMAT(v_now, '%Y-%m-%dT%H:%i:%s.%fZ')),
        v_now);
    COMMIT;
    SELECT 0 AS code, v_deal AS deal_id, v_user AS user_id, v_qty AS quantity, v_alloc AS alloc;
END$$

DELIMITER ;
