-- Routine gate_sell_held (introduced by 003_payments.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Part of the payment event logic (gate_payment_event_in_tx).

DELIMITER $$

-- Move an order's held units to sold on the buckets its allocation names, with one
-- ledger row per bucket. Part of the caller's transaction; the order row is locked.
CREATE OR REPLACE PROCEDURE gate_sell_held(
    IN p_order_id  CHAR(26) CHARACTER SET ascii,
    IN p_deal_id   BIGINT UNSIGNED,
    IN p_alloc     VARCHAR(255) CHARACTER SET ascii,
    IN p_op_id     CHAR(26) CHARACTER SET ascii,
    IN p_actor     VARCHAR(64),
    IN p_now       DATETIME(6))
SQL SECURITY INVOKER
BEGIN
    DECLARE v_nb     INT UNSIGNED;
    DECLARE v_epoch  INT UNSIGNED;
    DECLARE v_rest   VARCHAR(255) CHARACTER SET ascii DEFAULT p_alloc;
    DECLARE v_part   VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_b      INT UNSIGNED;
    DECLARE v_q      BIGINT UNSIGNED;
    DECLARE v_avail  BIGINT UNSIGNED;

    SELECT bucket_count, layout_epoch INTO v_nb, v_epoch FROM deals WHERE id = p_deal_id;
    WHILE v_rest <> '' DO
        SET v_part = SUBSTRING_INDEX(v_rest, ',', 1);
        SET v_rest = IF(LOCATE(',', v_rest) > 0, SUBSTRING(v_rest, LOCATE(',', v_rest) + 1), '');
        SET v_b = CAST(SUBSTRING_INDEX(v_part, ':', 1) AS UNSIGNED) MOD v_nb;
        SET v_q = CAST(SUBSTRING_INDEX(v_part, ':', -1) AS UNSIGNED);
        UPDATE deal_buckets
           SET held = held - v_q, sold = sold + v_q, updated_at = p_now
         WHERE deal_id = p_deal_id AND bucket = v_b AND epoch = v_epoch;
        IF ROW_COUNT() = 0 THEN
            SIGNAL SQLSTATE '40001'
                SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: bucket layout changed; retry';
        END IF;
        SELECT available INTO v_avail FROM deal_buckets WHERE deal_id = p_deal_id AND bucket = v_b;
        INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total, d_available,
            d_held, d_sold, available_before, available_after, reason, actor, created_at)
        VALUES (p_deal_id, v_b, p_order_id, p_op_id, 0, 0, -CAST(v_q AS SIGNED), v_q,
            v_avail, v_avail, 'pay', p_actor, p_now);
    END WHILE;
END$$

DELIMITER ;
