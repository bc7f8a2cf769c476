-- Routine gate_expire_batch (introduced by 004_expiry.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- The expiry sweeper's batch release (docs/expiry.md): set-based statements, so the
-- server's work grows linearly with the batch.

DELIMITER $$

-- Release a batch of due holds the caller has locked in this transaction.
--
-- The caller (gate/expiry/sweeper.py) has already run START TRANSACTION and
--   SELECT … FROM orders WHERE status = … AND expires_at <= NOW(6)
--   ORDER BY expires_at LIMIT n FOR UPDATE SKIP LOCKED
-- and recorded one Redis intent per order (docs/redis-mirror.md). This procedure
-- finishes and COMMITs that transaction.
--   p_batch  JSON array of ["order id", "intent id"] pairs; the intent id marks the
--            order's ledger rows (op_id) and is its outbox event id
--   p_actor  who released (ledger actor)
-- Returns one row: code 0, the number of orders released, and the database time of
-- the release. Errors roll the whole batch back:
--   errno 1213 (SQLSTATE 40001): a bucket row is not in the layout read in this
--     transaction (a rebucketing committed meanwhile): run the batch again;
--   SQLSTATE 45000: an order of the batch was not holding and due (the caller did
--     not lock it as required): a bug, nothing changed.
CREATE OR REPLACE PROCEDURE gate_expire_batch(
    IN p_batch  LONGTEXT CHARACTER SET utf8mb4,
    IN p_actor  VARCHAR(64))
SQL SECURITY INVOKER
proc: BEGIN
    DECLARE v_now     DATETIME(6);
    DECLARE v_orders  INT UNSIGNED;
    DECLARE v_groups  INT UNSIGNED;
    DECLARE v_values  LONGTEXT CHARACTER SET utf8mb4;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    SET v_now = NOW(6);
    CALL gate_expire_scratch();

    -- One row per allocation part: "3:1,7:2" becomes [[3,1],[7,2]] for JSON_TABLE.
    -- The bucket number maps onto the layout read here; the epoch read with it is
    -- checked when the bucket rows are written.
    INSERT INTO gate_expire_parts (order_id, op_id, part_no, deal_id, user_id, quantity,
        expires_at, bucket, epoch, q)
    SELECT o.id, j.op_id, p.part_no, o.deal_id, o.user_id, o.quantity, o.expires_at,
           MOD(p.b, d.bucket_count), d.layout_epoch, p.q
      FROM JSON_TABLE(p_batch, '$[*]' COLUMNS (
               order_id CHAR(26) CHARACTER SET ascii PATH '$[0]',
               op_id    CHAR(26) CHARACTER SET ascii PATH '$[1]')) AS j
      STRAIGHT_JOIN orders AS o ON o.id = j.order_id
      STRAIGHT_JOIN deals AS d ON d.id = o.deal_id
      CROSS JOIN JSON_TABLE(CONCAT('[[', REPLACE(REPLACE(o.alloc, ',', '],['), ':', ','), ']]'),
               '$[*]' COLUMNS (
                   part_no FOR ORDINALITY,
                   b INT UNSIGNED PATH '$[0]',
                   q INT UNSIGNED PATH '$[1]')) AS p;

    SELECT COUNT(DISTINCT order_id), COUNT(DISTINCT deal_id, bucket)
      INTO v_orders, v_groups FROM gate_expire_parts;
    IF v_orders <> JSON_LENGTH(p_batch) THEN
        SIGNAL SQLSTATE '45000'
            SET MESSAGE_TEXT = 'gate: an order of the expiry batch does not exist';
    END IF;
    IF v_orders = 0 THEN
        COMMIT;
        SELECT 0 AS code, 0 AS released, v_now AS released_at;
        LEAVE proc;
    END IF;

    -- The conditional transition: only a holding order whose deadline has passed by
    -- the database clock expires; a payment that got there first wins.
    UPDATE gate_expire_parts AS t STRAIGHT_JOIN orders AS o ON o.id = t.order_id
       SET o.status = 'EXPIRED', o.closed_at = v_now, o.updated_at = v_now,
           o.version = o.version + 1
     WHERE t.part_no = 1 AND o.status IN ('PENDING_PAYMENT', 'AUTHORIZED')
       AND o.expires_at <= v_now;
    IF ROW_COUNT() <> v_orders THEN
        SIGNAL SQLSTATE '45000'
            SET MESSAGE_TEXT = 'gate: an order of the expiry batch was not holding and due';
    END IF;

    -- The buyers' per-user quota units come back (rows exist only for deals with a
    -- per-user limit).
    UPDATE (SELECT deal_id, user_id, SUM(quantity) AS units FROM gate_expire_parts
             WHERE part_no = 1 GROUP BY deal_id, user_id) AS t
      STRAIGHT_JOIN user_quota AS u ON u.deal_id = t.deal_id AND u.user_id = t.user_id
       SET u.units = u.units - t.units
     WHERE u.units >= t.units;

    -- Ledger and outbox rows go in as one multi-row INSERT … VALUES each, built here:
    -- with innodb_autoinc_lock_mode = 1 an INSERT … SELECT holds the table's AUTO-INC
    -- lock for the whole statement, which would stall every reservation's ledger
    -- insert meanwhile; a VALUES list of known length does not.
    SET SESSION group_concat_max_len = 268435456;
    SELECT GROUP_CONCAT(CONCAT_WS(',', QUOTE(op_id), '''order.expired''', QUOTE(order_id),
               QUOTE(JSON_OBJECT('order_id', order_id, 'deal_id', deal_id, 'user_id', user_id,
                   'quantity', quantity, 'status', 'EXPIRED', 'reason', 'expire',
                   'at', DATE_FORMAT(v_now, '%Y-%m-%dT%H:%i:%s.%fZ'))),
               QUOTE(v_now))
               ORDER BY order_id SEPARATOR '),(')
      INTO v_values
      FROM gate_expire_parts WHERE part_no = 1;
    SET @gate_expire_sql = CONCAT(
        'INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at) VALUES (',
        v_values, ')');
    PREPARE gate_expire_stmt FROM @gate_expire_sql;
    EXECUTE gate_expire_stmt;
    DEALLOCATE PREPARE gate_expire_stmt;

    -- One write per bucket for the whole batch, in the layout read above. Bucket rows
    -- are the contended ones, so they are locked last, just before the commit.
    UPDATE (SELECT deal_id, bucket, epoch, SUM(q) AS q FROM gate_expire_parts
             GROUP BY deal_id, bucket, epoch) AS t
      STRAIGHT_JOIN deal_buckets AS b
        ON b.deal_id = t.deal_id AND b.bucket = t.bucket AND b.epoch = t.epoch
       SET b.available = b.available + t.q, b.held = b.held - t.q, b.updated_at = v_now;
    IF ROW_COUNT() <> v_groups THEN
        SIGNAL SQLSTATE '40001'
            SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: bucket layout changed; retry';
    END IF;

    -- One ledger row per order part, carrying the order's intent id. Before/after
    -- replay the batch's single bucket write part by part, in order id order.
    SELECT GROUP_CONCAT(CONCAT_WS(',', x.deal_id, x.bucket, QUOTE(x.order_id), QUOTE(x.op_id),
               0, x.q, -CAST(x.q AS SIGNED), 0, b.available - x.total + x.running - x.q,
               b.available - x.total + x.running, '''expire''', QUOTE(p_actor), QUOTE(v_now))
               ORDER BY x.deal_id, x.bucket, x.order_id, x.part_no SEPARATOR '),(')
      INTO v_values
      FROM (SELECT deal_id, bucket, order_id, op_id, part_no, q,
                   SUM(q) OVER (PARTITION BY deal_id, bucket) AS total,
                   SUM(q) OVER (PARTITION BY deal_id, bucket ORDER BY order_id, part_no
                                ROWS UNBOUNDED PRECEDING) AS running
              FROM gate_expire_parts) AS x
      STRAIGHT_JOIN deal_buckets AS b ON b.deal_id = x.deal_id AND b.bucket = x.bucket;
    SET @gate_expire_sql = CONCAT(
        'INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,',
        ' d_available, d_held, d_sold, available_before, available_after, reason, actor,',
        ' created_at) VALUES (', v_values, ')');
    PREPARE gate_expire_stmt FROM @gate_expire_sql;
    EXECUTE gate_expire_stmt;
    DEALLOCATE PREPARE gate_expire_stmt;
    SET @gate_expire_sql = NULL;

    COMMIT;
    DELETE FROM gate_expire_parts;
    SELECT 0 AS code, v_orders AS released, v_now AS released_at;
END$$

DELIMITER ;
