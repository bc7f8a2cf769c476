-- Routine gate_payment_event_group (introduced by 005_callbacks.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Payment callbacks applied one at a time or in groups (docs/benchmarks-callbacks.md);
-- the event logic itself is gate_payment_event_in_tx (its codes are listed there).

DELIMITER $$

-- Several new events (mode 0) of one provider in one transaction: one round trip and
-- one COMMIT (one redo log flush) for the whole group.
--   p_events  JSON array of objects {"id", "type", "order", "payment", "amount",
--             "currency", "refund", "payload", "created", "tx"}; absent keys are NULL;
--             "created" is 'YYYY-MM-DD HH:MM:SS' (UTC), "tx" the outbox event id
-- Returns one row: a JSON array with one [code, outcome, detail, status, deal id,
-- waiting, capture] per event, in the order given.
--
-- Two lanes, one transaction. The common case (a payment.succeeded whose event, order
-- and payment appear once in the group, for an order that holds its units with the
-- same amount and currency, a payment and an event the database does not know yet)
-- is applied set-based: a handful of statements for the whole lane, writing exactly
-- the rows gate_payment_event_in_tx would (event 'applied', payment 'succeeded',
-- held -> sold with one 'pay' ledger row per bucket part, PAID, outbox 'order.paid').
-- Every other event (duplicates included) then runs through gate_payment_event_in_tx
-- one by one, in the order given. The set-based lane's orders and payments appear in
-- no other event of the group, so running it first changes no outcome.
CREATE OR REPLACE PROCEDURE gate_payment_event_group(
    IN p_provider  VARCHAR(32) CHARACTER SET ascii,
    IN p_events    LONGTEXT CHARACTER SET utf8mb4,
    IN p_actor     VARCHAR(64))
SQL SECURITY INVOKER
BEGIN
    DECLARE v_done     INT DEFAULT 0;
    DECLARE v_now      DATETIME(6);
    DECLARE v_fast     INT UNSIGNED;
    DECLARE v_locked   INT UNSIGNED;
    DECLARE v_groups   INT UNSIGNED;
    DECLARE v_values   LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_out      LONGTEXT CHARACTER SET utf8mb4;
    DECLARE v_n        INT UNSIGNED;
    DECLARE v_event_id VARCHAR(191) CHARACTER SET ascii;
    DECLARE v_type     VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_order_id CHAR(26) CHARACTER SET ascii;
    DECLARE v_pay_id   VARCHAR(191) CHARACTER SET ascii;
    DECLARE v_amount   BIGINT UNSIGNED;
    DECLARE v_currency CHAR(3) CHARACTER SET ascii;
    DECLARE v_refund   VARCHAR(191) CHARACTER SET ascii;
    DECLARE v_payload  MEDIUMTEXT CHARACTER SET utf8mb4;
    DECLARE v_created  DATETIME(6);
    DECLARE v_tx_id    CHAR(26) CHARACTER SET ascii;
    DECLARE v_code     INT;
    DECLARE v_outcome  VARCHAR(32) CHARACTER SET ascii;
    DECLARE v_detail   VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_status   VARCHAR(20) CHARACTER SET ascii;
    DECLARE v_deal     BIGINT UNSIGNED;
    DECLARE v_waiting  INT;
    DECLARE v_capture  INT;
    DECLARE slow CURSOR FOR
        SELECT n, event_id, event_type, order_id, payment_id, amount, currency, refund_id,
               payload, created, tx_id
          FROM gate_cb_events WHERE fast = 0 AND code IS NULL ORDER BY n;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_done = 1;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    START TRANSACTION;
    SET v_now = NOW(6);
    CALL gate_cb_scratch();
    INSERT INTO gate_cb_events (n, event_id, event_type, order_id, payment_id, amount,
        currency, refund_id, payload, created, tx_id, fast)
    SELECT j.n, j.event_id, j.event_type, j.order_id, j.payment_id, j.amount, j.currency,
           j.refund_id, j.payload, j.created, j.tx_id,
           -- A candidate for the set-based lane; confirmed against the rows below.
           j.event_type = 'payment.succeeded' AND j.order_id IS NOT NULL
             AND j.payment_id IS NOT NULL AND j.amount IS NOT NULL AND j.currency IS NOT NULL
             AND COUNT(*) OVER (PARTITION BY j.event_id) = 1
             AND COUNT(*) OVER (PARTITION BY j.order_id) = 1
             AND COUNT(*) OVER (PARTITION BY j.payment_id) = 1
      FROM JSON_TABLE(p_events, '$[*]' COLUMNS (
               n          FOR ORDINALITY,
               event_id   VARCHAR(191) CHARACTER SET ascii PATH '$.id',
               event_type VARCHAR(64) CHARACTER SET ascii PATH '$.type',
               order_id   CHAR(26) CHARACTER SET ascii PATH '$.order',
               payment_id VARCHAR(191) CHARACTER SET ascii PATH '$.payment',
               amount     BIGINT UNSIGNED PATH '$.amount',
               currency   CHAR(3) CHARACTER SET ascii PATH '$.currency',
               refund_id  VARCHAR(191) CHARACTER SET ascii PATH '$.refund',
               payload    MEDIUMTEXT CHARACTER SET utf8mb4 PATH '$.payload',
               created    DATETIME(6) PATH '$.created',
               tx_id      CHAR(26) CHARACTER SET ascii PATH '$.tx')) AS j;

    -- The candidates' order rows, locked before anything is written, then checked.
    -- Two groups sharing orders (a redelivery racing its original in the other
    -- worker) may still deadlock on them; the loser rolls back whole and the caller
    -- runs the group again (bounded), then one event at a time.
    SELECT COUNT(*) INTO v_locked FROM (
        SELECT o.id FROM orders AS o
         WHERE o.id IN (SELECT order_id FROM gate_cb_events WHERE fast = 1)
         ORDER BY o.id FOR UPDATE) AS locked;
    UPDATE gate_cb_events AS e STRAIGHT_JOIN orders AS o ON o.id = e.order_id
       SET e.deal_id = o.deal_id, e.user_id = o.user_id, e.quantity = o.quantity,
           e.alloc = o.alloc, e.checked = 1
     WHERE e.fast = 1 AND o.status IN ('PENDING_PAYMENT', 'AUTHORIZED')
       AND o.amount = e.amount AND o.currency = e.currency;
    UPDATE gate_cb_events SET fast = 0 WHERE fast = 1 AND checked = 0;
    -- Redeliveries of events committed before: answered here, without the other lane
    -- (which would try the INSERT and stop at the key). One still in flight in another
    -- transaction is not visible yet: the other lane waits for it and finds the key.
    UPDATE gate_cb_events AS e STRAIGHT_JOIN payment_events AS x
        ON x.provider = p_provider AND x.event_id = e.event_id
       SET e.fast = 0, e.code = 1, e.outcome = 'duplicate', e.deal_id = NULL;
    UPDATE gate_cb_events AS e STRAIGHT_JOIN payments AS p
        ON p.provider = p_provider AND p.payment_id = e.payment_id
       SET e.fast = 0 WHERE e.fast = 1;
    SELECT COUNT(*) INTO v_fast FROM gate_cb_events WHERE fast = 1;

    IF v_fast > 0 THEN
        INSERT INTO payment_events (provider, event_id, event_type, order_id, payment_id,
            refund_id, amount, currency, payload, outcome, detail, event_created_at,
            received_at, processed_at)
        SELECT p_provider, event_id, event_type, order_id, payment_id, NULL, amount,
               currency, payload, 'applied', NULL, created, v_now, v_now
          FROM gate_cb_events WHERE fast = 1 ORDER BY n;
        INSERT INTO payments (provider, payment_id, order_id, amount, currency, status,
            created_at, updated_at)
        SELECT p_provider, payment_id, order_id, amount, currency, 'succeeded', v_now, v_now
          FROM gate_cb_events WHERE fast = 1 ORDER BY n;
        UPDATE gate_cb_events AS e STRAIGHT_JOIN orders AS o ON o.id = e.order_id
           SET o.status = 'PAID', o.paid_amount = o.paid_amount + e.amount,
               o.provider_payment_id = e.payment_id, o.paid_at = v_now, o.updated_at = v_now,
               o.version = o.version + 1
         WHERE e.fast = 1 AND o.status IN ('PENDING_PAYMENT', 'AUTHORIZED');
        IF ROW_COUNT() <> v_fast THEN
            SIGNAL SQLSTATE '40001'
                SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: an order moved; retry';
        END IF;

        -- Held -> sold on the buckets each order's allocation names, in the layout
        -- read here (as gate_sell_held). Bucket rows are the contended ones: locked
        -- last, in bucket order.
        INSERT INTO gate_cb_parts (n, part_no, deal_id, bucket, epoch, q)
        SELECT e.n, a.part_no, e.deal_id, MOD(a.b, d.bucket_count), d.layout_epoch, a.q
          FROM gate_cb_events AS e
          STRAIGHT_JOIN deals AS d ON d.id = e.deal_id
          CROSS JOIN JSON_TABLE(CONCAT('[[', REPLACE(REPLACE(e.alloc, ',', '],['), ':', ','),
                   ']]'), '$[*]' COLUMNS (
                       part_no FOR ORDINALITY,
                       b INT UNSIGNED PATH '$[0]',
                       q INT UNSIGNED PATH '$[1]')) AS a
         WHERE e.fast = 1;
        SELECT COUNT(DISTINCT deal_id, bucket) INTO v_groups FROM gate_cb_parts;
        UPDATE (SELECT deal_id, bucket, epoch, SUM(q) AS q FROM gate_cb_parts
                 GROUP BY deal_id, bucket, epoch ORDER BY deal_id, bucket) AS t
          STRAIGHT_JOIN deal_buckets AS b
            ON b.deal_id = t.deal_id AND b.bucket = t.bucket AND b.epoch = t.epoch
           SET b.held = b.held - t.q, b.sold = b.sold + t.q, b.updated_at = v_now;
        IF ROW_COUNT() <> v_groups THEN
            SIGNAL SQLSTATE '40001'
                SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: bucket layout changed; retry';
        END IF;

        -- Ledger and outbox rows as one multi-row INSERT … VALUES each (see 004: an
        -- INSERT … SELECT would hold the AUTO-INC lock for the whole statement).
        SET SESSION group_concat_max_len = 268435456;
        SELECT GROUP_CONCAT(CONCAT_WS(',', p.deal_id, p.bucket, QUOTE(e.order_id),
                   QUOTE(e.tx_id), 0, 0, -CAST(p.q AS SIGNED), p.q, b.available, b.available,
                   '''pay''', QUOTE(p_actor), QUOTE(v_now))
                   ORDER BY p.n, p.part_no SEPARATOR '),(')
          INTO v_values
          FROM gate_cb_parts AS p
          STRAIGHT_JOIN gate_cb_events AS e ON e.n = p.n
          STRAIGHT_JOIN deal_buckets AS b ON b.deal_id = p.deal_id AND b.bucket = p.bucket;
        SET @gate_cb_sql = CONCAT(
            'INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,',
            ' d_available, d_held, d_sold, available_before, available_after, reason, actor,',
            ' created_at) VALUES (', v_values, ')');
        PREPARE gate_cb_stmt FROM @gate_cb_sql;
        EXECUTE gate_cb_stmt;
        SELECT GROUP_CONCAT(CONCAT_WS(',', QUOTE(tx_id), '''order.paid''', QUOTE(order_id),
                   QUOTE(JSON_OBJECT('order_id', order_id, 'deal_id', deal_id,
                       'user_id', user_id, 'quantity', quantity, 'status', 'PAID',
                       'provider', p_provider, 'payment_id', payment_id, 'refund_id', NULL,
                       'amount', amount, 'currency', currency, 'event_id', event_id,
                       'event_type', event_type, 'detail', NULL,
                       'at', DATE_FORMAT(v_now, '%Y-%m-%dT%H:%i:%s.%fZ'))),
                   QUOTE(v_now))
                   ORDER BY n SEPARATOR '),(')
          INTO v_values
          FROM gate_cb_events WHERE fast = 1;
        SET @gate_cb_sql = CONCAT(
            'INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at) VALUES (',
            v_values, ')');
        PREPARE gate_cb_stmt FROM @gate_cb_sql;
        EXECUTE gate_cb_stmt;
        DEALLOCATE PREPARE gate_cb_stmt;
        SET @gate_cb_sql = NULL;

        -- Refunds that arrived before their payment wait for it (as in the other lane).
        UPDATE gate_cb_events AS e
           SET e.code = 0, e.outcome = 'applied', e.status = 'PAID',
               e.waiting = (SELECT COUNT(*) FROM payment_events AS w
                             WHERE w.order_id = e.order_id AND w.outcome = 'waiting')
         WHERE e.fast = 1;
    END IF;

    OPEN slow;
    each_event: LOOP
        FETCH slow INTO v_n, v_event_id, v_type, v_order_id, v_pay_id, v_amount, v_currency,
            v_refund, v_payload, v_created, v_tx_id;
        IF v_done = 1 THEN
            LEAVE each_event;
        END IF;
        CALL gate_payment_event_in_tx(0, p_provider, v_event_id, v_type, v_order_id, v_pay_id,
            v_amount, v_currency, v_refund, v_payload, v_created, v_tx_id, p_actor,
            v_code, v_outcome, v_detail, v_status, v_deal, v_waiting, v_capture);
        -- The callee's NOT FOUND handler consumed its own lookups; ours is for FETCH.
        SET v_done = 0;
        UPDATE gate_cb_events
           SET code = v_code, outcome = v_outcome, detail = v_detail, status = v_status,
               deal_id = v_deal, waiting = v_waiting, capture = v_capture
         WHERE n = v_n;
    END LOOP;
    CLOSE slow;

    SELECT CONCAT('[', COALESCE(GROUP_CONCAT(JSON_ARRAY(code, outcome, detail, status,
               COALESCE(deal_id, 0), waiting, capture) ORDER BY n SEPARATOR ','), ''), ']')
      INTO v_out FROM gate_cb_events;
    COMMIT;
    SELECT v_out AS results;
END$$

DELIMITER ;
