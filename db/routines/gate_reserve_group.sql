-- Routine gate_reserve_group (introduced by 006_reserve_groups.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Group commit of admitted reservations of one deal (docs/reservation-groups.md).
-- Result codes (mirrored by gate.base.codes.DbCode): 0 OK, 4 NOT_FOUND, 5 NOT_ACTIVE,
-- 8 FALL_BACK (nothing written; the caller runs each item through gate_reserve).

DELIMITER $$

CREATE OR REPLACE PROCEDURE gate_reserve_group(
    IN p_deal_id  BIGINT UNSIGNED,
    IN p_items    LONGTEXT CHARACTER SET utf8mb4)
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
    DECLARE v_n         INT UNSIGNED;
    DECLARE v_all       INT UNSIGNED;
    DECLARE v_parts     INT UNSIGNED;
    DECLARE v_over      INT UNSIGNED;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    -- An idempotency key the database already holds (a replay whose Redis record was
    -- lost): each item on its own finds out which one.
    DECLARE EXIT HANDLER FOR 1062
    BEGIN
        ROLLBACK;
        SELECT 8 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
               NULL AS currency;
    END;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    SELECT unit_price, currency, title, hold_seconds, per_user_limit, max_per_order,
           bucket_count, layout_epoch, capture_mode, starts_at, ends_at
      INTO v_price, v_currency, v_title, v_hold, v_limit, v_max,
           v_nb, v_epoch, v_capture, v_starts, v_ends
      FROM deals WHERE id = p_deal_id;
    IF v_found = 0 THEN
        SELECT 4 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
               NULL AS currency;
        LEAVE proc;
    END IF;
    SET v_now = NOW(6);
    IF (v_starts IS NOT NULL AND v_now < v_starts) OR (v_ends IS NOT NULL AND v_now >= v_ends) THEN
        SELECT 5 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
               NULL AS currency;
        LEAVE proc;
    END IF;

    START TRANSACTION;
    -- The session's scratch table, emptied; created by the first call of a session.
    BEGIN
        DECLARE CONTINUE HANDLER FOR 1146 CALL gate_reserve_scratch();
        DELETE FROM gate_rg_items;
    END;
    INSERT INTO gate_rg_items (n, order_id, user_id, quantity, bucket, idempotency_key,
        fingerprint)
    SELECT j.n, j.order_id, j.user_id, j.quantity, j.bucket MOD v_nb, j.idempotency_key,
           j.fingerprint
      FROM JSON_TABLE(p_items, '$[*]' COLUMNS (
               n                FOR ORDINALITY,
               order_id         CHAR(26) CHARACTER SET ascii PATH '$[0]',
               user_id          BIGINT UNSIGNED PATH '$[1]',
               quantity         INT UNSIGNED PATH '$[2]',
               bucket           INT UNSIGNED PATH '$[3]',
               idempotency_key  VARCHAR(255) CHARACTER SET ascii PATH '$[4]',
               fingerprint      CHAR(32) CHARACTER SET ascii PATH '$[5]')) AS j;
    -- Every item whole and within the deal's maximum, or each goes on its own.
    SELECT COUNT(*), COUNT(DISTINCT bucket),
           COALESCE(SUM(quantity BETWEEN 1 AND v_max AND order_id IS NOT NULL
               AND user_id IS NOT NULL AND bucket IS NOT NULL
               AND idempotency_key IS NOT NULL AND fingerprint IS NOT NULL), 0)
      INTO v_all, v_parts, v_n FROM gate_rg_items;
    IF v_n = 0 OR v_n <> v_all THEN
        ROLLBACK;
        SELECT 8 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
               NULL AS currency;
        LEAVE proc;
    END IF;

    -- The orders first: a key the database already holds stops the group here, before
    -- any bucket row is locked.
    INSERT INTO orders (id, deal_id, user_id, quantity, unit_price, amount, currency, title,
        status, alloc, idempotency_key, request_fingerprint, capture_mode, expires_at,
        created_at, updated_at)
    SELECT order_id, p_deal_id, user_id, quantity, v_price, v_price * quantity, v_currency,
           v_title, 'PENDING_PAYMENT', CONCAT(bucket, ':', quantity), idempotency_key,
           fingerprint, v_capture, v_now + INTERVAL v_hold SECOND, v_now, v_now
      FROM gate_rg_items ORDER BY n;

    IF v_limit IS NOT NULL THEN
        INSERT INTO user_quota (deal_id, user_id, units)
        SELECT p_deal_id, user_id, SUM(quantity) FROM gate_rg_items GROUP BY user_id
            ON DUPLICATE KEY UPDATE units = units + VALUES(units);
        SELECT COUNT(*) INTO v_over FROM user_quota
         WHERE deal_id = p_deal_id AND units > v_limit
           AND user_id IN (SELECT user_id FROM gate_rg_items);
        IF v_over > 0 THEN
            ROLLBACK;
            SELECT 8 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
                   NULL AS currency;
            LEAVE proc;
        END IF;
    END IF;

    -- The contended rows last, locked in bucket order, each taken once for the whole
    -- group. Every bucket must hold its share: otherwise the items go one by one (and
    -- gate_reserve falls over to other buckets for the ones Redis misplaced).
    UPDATE (SELECT bucket, SUM(quantity) AS q FROM gate_rg_items
             GROUP BY bucket ORDER BY bucket) AS t
      STRAIGHT_JOIN deal_buckets AS b ON b.deal_id = p_deal_id AND b.bucket = t.bucket
       SET b.available = b.available - t.q, b.held = b.held + t.q, b.updated_at = v_now
     WHERE b.epoch = v_epoch AND b.available >= t.q;
    IF ROW_COUNT() <> v_parts THEN
        ROLLBACK;
        SELECT 8 AS code, NULL AS expires_at, NULL AS created_at, NULL AS unit_price,
               NULL AS currency;
        LEAVE proc;
    END IF;

    -- One ledger row per order, as gate_reserve writes them: within a bucket the items
    -- take their units in item order, so each row's before/after follows from the
    -- bucket's new count and the units of the items after it. (With
    -- innodb_autoinc_lock_mode = 1 an INSERT … SELECT holds the ledger's AUTO-INC lock
    -- to its end; this one reads only the session's scratch table and bucket rows the
    -- transaction holds already, so it never waits while holding it.)
    INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total, d_available,
        d_held, d_sold, available_before, available_after, reason, actor, created_at)
    SELECT p_deal_id, t.bucket, t.order_id, t.order_id, 0, -CAST(t.quantity AS SIGNED),
           t.quantity, 0, b.available + t.later + t.quantity, b.available + t.later,
           'reserve', CONCAT('user:', t.user_id), v_now
      FROM (SELECT n, order_id, user_id, quantity, bucket,
                   COALESCE(SUM(quantity) OVER (PARTITION BY bucket ORDER BY n DESC
                       ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS later
              FROM gate_rg_items) AS t
      STRAIGHT_JOIN deal_buckets AS b ON b.deal_id = p_deal_id AND b.bucket = t.bucket
     ORDER BY t.n;
    COMMIT;
    SELECT 0 AS code, v_now + INTERVAL v_hold SECOND AS expires_at, v_now AS created_at,
           v_price AS unit_price, v_currency AS currency, v_nb AS bucket_count;
END$$

DELIMITER ;
