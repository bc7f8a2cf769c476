-- Gate payments, version 5: payment callbacks applied in groups (issue #4's speed
-- target, docs/benchmarks-callbacks.md).
--
-- The event logic of 003 moves, unchanged, into gate_payment_event_in_tx, which runs
-- inside its caller's transaction and hands its result back in OUT parameters. Two
-- callers:
--   gate_payment_event       one event, one transaction (as before; same signature,
--                            same result row): the synthetic events, the re-run of
--                            waiting events, and the fallback of a failed group;
--   gate_payment_event_group several callbacks in one transaction and one COMMIT
--                            (group commit): each event is still its own conditional
--                            transition on its order row, and a duplicate still stops
--                            at the event's primary key, without undoing the others.
-- A group is all or nothing: any error (a deadlock between two groups, a concurrent
-- payment row, a bucket layout change) rolls the whole group back and the caller runs
-- it again, or one event at a time.

DROP PROCEDURE IF EXISTS gate_payment_event;

DELIMITER $$

-- One provider event inside the caller's transaction (see 003 for the codes). A
-- duplicate (code 1) writes nothing; the caller decides what to commit.
CREATE PROCEDURE gate_payment_event_in_tx(
    IN p_mode        TINYINT,
    IN p_provider    VARCHAR(32) CHARACTER SET ascii,
    IN p_event_id    VARCHAR(191) CHARACTER SET ascii,
    IN p_type        VARCHAR(64) CHARACTER SET ascii,
    IN p_order_id    CHAR(26) CHARACTER SET ascii,
    IN p_payment_id  VARCHAR(191) CHARACTER SET ascii,
    IN p_amount      BIGINT UNSIGNED,
    IN p_currency    CHAR(3) CHARACTER SET ascii,
    IN p_refund_id   VARCHAR(191) CHARACTER SET ascii,
    IN p_payload     MEDIUMTEXT,
    IN p_created     DATETIME(6),
    IN p_tx_id       CHAR(26) CHARACTER SET ascii,
    IN p_actor       VARCHAR(64),
    OUT o_code       INT,
    OUT o_outcome    VARCHAR(32) CHARACTER SET ascii,
    OUT o_detail     VARCHAR(64) CHARACTER SET ascii,
    OUT o_status     VARCHAR(20) CHARACTER SET ascii,
    OUT o_deal       BIGINT UNSIGNED,
    OUT o_waiting    INT,
    OUT o_capture    INT)
SQL SECURITY INVOKER
proc: BEGIN
    DECLARE v_found      INT DEFAULT 1;
    DECLARE v_dup        INT DEFAULT 0;
    DECLARE v_code       INT DEFAULT 2;
    DECLARE v_outcome    VARCHAR(32) CHARACTER SET ascii DEFAULT 'ignored';
    DECLARE v_detail     VARCHAR(64) CHARACTER SET ascii DEFAULT NULL;
    DECLARE v_now        DATETIME(6);
    DECLARE v_prev       VARCHAR(32) CHARACTER SET ascii;
    DECLARE v_has_order  INT DEFAULT 0;
    DECLARE v_status     VARCHAR(20) CHARACTER SET ascii DEFAULT NULL;
    DECLARE v_deal       BIGINT UNSIGNED DEFAULT 0;
    DECLARE v_user       BIGINT UNSIGNED;
    DECLARE v_qty        INT UNSIGNED;
    DECLARE v_amount     BIGINT UNSIGNED;
    DECLARE v_currency   CHAR(3) CHARACTER SET ascii;
    DECLARE v_alloc      VARCHAR(255) CHARACTER SET ascii;
    DECLARE v_expires    DATETIME(6);
    DECLARE v_paid       BIGINT UNSIGNED;
    DECLARE v_refunded   BIGINT UNSIGNED;
    DECLARE v_order_pay  VARCHAR(191) CHARACTER SET ascii;
    DECLARE v_p_status   VARCHAR(16) CHARACTER SET ascii DEFAULT NULL;
    DECLARE v_p_amount   BIGINT UNSIGNED;
    DECLARE v_p_refunded BIGINT UNSIGNED;
    DECLARE v_p_currency CHAR(3) CHARACTER SET ascii;
    DECLARE v_r_id       BIGINT UNSIGNED DEFAULT NULL;
    DECLARE v_r_status   VARCHAR(16) CHARACTER SET ascii;
    DECLARE v_r_amount   BIGINT UNSIGNED;
    DECLARE v_r_provider_id VARCHAR(191) CHARACTER SET ascii;
    DECLARE v_waiting    INT DEFAULT 0;
    DECLARE v_capture    INT DEFAULT 0;
    DECLARE v_topic      VARCHAR(64) CHARACTER SET ascii DEFAULT NULL;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE CONTINUE HANDLER FOR 1062 SET v_dup = 1;
    SET o_code = 1, o_outcome = 'duplicate', o_detail = NULL, o_status = NULL, o_deal = 0,
        o_waiting = 0, o_capture = 0;
    SET v_now = NOW(6);
    IF p_mode = 0 THEN
        INSERT INTO payment_events (provider, event_id, event_type, order_id, payment_id,
            refund_id, amount, currency, payload, outcome, event_created_at, received_at)
        VALUES (p_provider, p_event_id, p_type, p_order_id, p_payment_id, p_refund_id,
            p_amount, p_currency, p_payload, 'received', p_created, v_now);
        IF v_dup = 1 THEN
            -- Nothing was written: the failed INSERT undid only itself.
            LEAVE proc;
        END IF;
    ELSE
        SET v_found = 1;
        SELECT outcome INTO v_prev FROM payment_events
         WHERE provider = p_provider AND event_id = p_event_id FOR UPDATE;
        IF v_found = 0 OR v_prev <> 'waiting' THEN
            LEAVE proc;
        END IF;
    END IF;

    IF p_order_id IS NOT NULL THEN
        SET v_found = 1;
        SELECT status, deal_id, user_id, quantity, amount, currency, alloc, expires_at,
               paid_amount, refunded_amount, provider_payment_id
          INTO v_status, v_deal, v_user, v_qty, v_amount, v_currency, v_alloc, v_expires,
               v_paid, v_refunded, v_order_pay
          FROM orders WHERE id = p_order_id FOR UPDATE;
        SET v_has_order = v_found;
    END IF;
    IF p_payment_id IS NOT NULL THEN
        SET v_found = 1;
        SELECT status, amount, refunded_amount, currency
          INTO v_p_status, v_p_amount, v_p_refunded, v_p_currency
          FROM payments WHERE provider = p_provider AND payment_id = p_payment_id FOR UPDATE;
        IF v_found = 0 THEN
            SET v_p_status = NULL;
        END IF;
    END IF;

    main: BEGIN
        IF p_type NOT IN ('payment.succeeded', 'payment.authorized', 'payment.failed',
                          'authorization.voided', 'refund.succeeded', 'refund.failed') THEN
            SET v_detail = 'unknown_type';
            LEAVE main;
        END IF;
        IF p_payment_id IS NULL THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'no_payment_id';
            LEAVE main;
        END IF;
        IF v_has_order = 0 THEN
            IF p_type IN ('payment.failed', 'authorization.voided') THEN
                SET v_detail = 'unknown_order';
            ELSE
                SET v_code = 3, v_outcome = 'quarantined', v_detail = 'unknown_order';
            END IF;
            LEAVE main;
        END IF;

        -- Payments: the amount and currency must be the order's, to the minor unit.
        IF p_type IN ('payment.succeeded', 'payment.authorized') THEN
            IF p_currency IS NULL OR p_currency <> v_currency THEN
                SET v_code = 3, v_outcome = 'quarantined', v_detail = 'currency_mismatch';
                LEAVE main;
            END IF;
            IF p_amount IS NULL OR p_amount <> v_amount THEN
                SET v_code = 3, v_outcome = 'quarantined', v_detail = 'amount_mismatch';
                LEAVE main;
            END IF;
            IF v_p_status IS NOT NULL AND v_p_currency <> p_currency THEN
                SET v_code = 3, v_outcome = 'quarantined', v_detail = 'payment_changed';
                LEAVE main;
            END IF;
        END IF;

        IF p_type = 'payment.succeeded' THEN
            IF v_p_status = 'succeeded' THEN
                SET v_detail = 'already_succeeded';
                LEAVE main;
            END IF;
            IF v_p_status IS NULL THEN
                INSERT INTO payments (provider, payment_id, order_id, amount, currency, status,
                    created_at, updated_at)
                VALUES (p_provider, p_payment_id, p_order_id, p_amount, p_currency, 'succeeded',
                    v_now, v_now);
                CALL gate_retry_if(v_dup);
            ELSE
                UPDATE payments SET status = 'succeeded', amount = p_amount,
                       next_action_at = NULL, updated_at = v_now
                 WHERE provider = p_provider AND payment_id = p_payment_id;
            END IF;
            IF v_status IN ('PENDING_PAYMENT', 'AUTHORIZED') THEN
                -- The units are still held for this order (whatever expires_at says,
                -- nobody else can have them until a release commits), so paying from
                -- them is what releasing and re-taking would do, without the risk.
                CALL gate_sell_held(p_order_id, v_deal, v_alloc, p_tx_id, p_actor, v_now);
                UPDATE orders
                   SET status = 'PAID', paid_amount = paid_amount + p_amount,
                       provider_payment_id = p_payment_id, paid_at = v_now,
                       updated_at = v_now, version = version + 1
                 WHERE id = p_order_id;
                SET v_code = 0, v_outcome = 'applied', v_status = 'PAID',
                    v_topic = 'order.paid', v_paid = v_paid + p_amount;
            ELSEIF v_status IN ('EXPIRED', 'CANCELLED') THEN
                -- The hold ended before the money arrived: the caller re-takes stock
                -- or refunds (gate.payments.late), with a Redis intent it must record
                -- before that transaction.
                SET v_code = 4, v_outcome = 'late';
            ELSE
                -- A second payment for an order that is already paid or being
                -- refunded: the buyer gets it back.
                UPDATE orders SET paid_amount = paid_amount + p_amount, updated_at = v_now,
                       version = version + 1
                 WHERE id = p_order_id;
                INSERT INTO payment_refunds (provider, payment_id, order_id, amount, currency,
                    reason, next_attempt_at, created_at, updated_at)
                VALUES (p_provider, p_payment_id, p_order_id, p_amount, p_currency,
                    'second_payment', v_now, v_now, v_now);
                CALL gate_retry_if(v_dup);
                SET v_code = 0, v_outcome = 'applied', v_detail = 'second_payment',
                    v_topic = 'payment.refund_scheduled';
            END IF;
            LEAVE main;
        END IF;

        IF p_type = 'payment.authorized' THEN
            IF v_p_status IN ('authorized', 'succeeded', 'voided') THEN
                SET v_detail = 'stale';
                LEAVE main;
            END IF;
            IF v_p_status IS NULL THEN
                INSERT INTO payments (provider, payment_id, order_id, amount, currency, status,
                    next_action_at, created_at, updated_at)
                VALUES (p_provider, p_payment_id, p_order_id, p_amount, p_currency, 'authorized',
                    v_now, v_now, v_now);
                CALL gate_retry_if(v_dup);
            ELSE
                UPDATE payments SET status = 'authorized', amount = p_amount,
                       next_action_at = v_now, updated_at = v_now
                 WHERE provider = p_provider AND payment_id = p_payment_id;
            END IF;
            -- The capture worker captures while the hold is valid; an authorization
            -- whose order is not (or no longer) AUTHORIZED by it is voided instead.
            SET v_capture = 1;
            IF v_status = 'PENDING_PAYMENT' AND v_expires > v_now THEN
                UPDATE orders
                   SET status = 'AUTHORIZED', provider_payment_id = p_payment_id,
                       authorized_at = v_now, updated_at = v_now, version = version + 1
                 WHERE id = p_order_id;
                SET v_code = 0, v_outcome = 'applied', v_status = 'AUTHORIZED',
                    v_topic = 'order.authorized';
            ELSE
                SET v_code = 0, v_outcome = 'applied', v_detail = 'to_void';
            END IF;
            LEAVE main;
        END IF;

        IF p_type = 'payment.failed' THEN
            -- A failed attempt leaves the order as it is: the buyer may try again
            -- while the hold lasts. A failure after a success changes nothing.
            IF v_p_status IS NULL THEN
                INSERT INTO payments (provider, payment_id, order_id, amount, currency, status,
                    created_at, updated_at)
                VALUES (p_provider, p_payment_id, p_order_id, COALESCE(p_amount, 0),
                    COALESCE(p_currency, v_currency), 'failed', v_now, v_now);
                CALL gate_retry_if(v_dup);
            END IF;
            SET v_detail = IF(v_p_status IS NULL, 'failed', 'after_progress');
            LEAVE main;
        END IF;

        IF p_type = 'authorization.voided' THEN
            IF v_p_status = 'authorized' THEN
                UPDATE payments SET status = 'voided', next_action_at = NULL, updated_at = v_now
                 WHERE provider = p_provider AND payment_id = p_payment_id;
                SET v_code = 0, v_outcome = 'applied', v_detail = 'voided';
            ELSE
                SET v_detail = 'stale';
            END IF;
            LEAVE main;
        END IF;

        -- Refunds: they wait until the payment they return is known to be captured.
        IF v_p_status IS NULL OR v_p_status <> 'succeeded' THEN
            SET v_code = 5, v_outcome = 'waiting';
            LEAVE main;
        END IF;
        IF p_refund_id IS NULL THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'no_refund_id';
            LEAVE main;
        END IF;
        -- The gate refunds a payment at most once (one row per payment): lock that row
        -- and decide on what it says now. It is this refund when it carries its id,
        -- or when it was asked for and not answered yet (a webhook can overtake the
        -- provider's answer to the worker); any other refund is not the gate's.
        SET v_found = 1;
        SELECT id, status, amount, provider_refund_id
          INTO v_r_id, v_r_status, v_r_amount, v_r_provider_id
          FROM payment_refunds
         WHERE provider = p_provider AND payment_id = p_payment_id FOR UPDATE;
        IF v_found = 0 OR NOT (v_r_provider_id <=> p_refund_id
                               OR (v_r_provider_id IS NULL AND v_r_status <> 'succeeded')) THEN
            SET v_r_id = NULL;
        END IF;
        IF v_r_id IS NULL THEN
            IF v_status IN ('EXPIRED', 'CANCELLED') THEN
                -- The late settlement that will ask for this refund has not run yet.
                SET v_code = 5, v_outcome = 'waiting';
            ELSE
                SET v_code = 3, v_outcome = 'quarantined', v_detail = 'unexpected_refund';
            END IF;
            LEAVE main;
        END IF;

        IF p_type = 'refund.failed' THEN
            IF v_r_status = 'succeeded' THEN
                SET v_detail = 'stale';
            ELSE
                -- Declined: the next attempt is a new refund with the next key.
                UPDATE payment_refunds
                   SET status = 'pending', generation = generation + 1,
                       provider_refund_id = NULL, last_error = 'refund.failed',
                       next_attempt_at = v_now + INTERVAL LEAST(300, POW(2, attempts)) SECOND,
                       updated_at = v_now
                 WHERE id = v_r_id;
                SET v_code = 0, v_outcome = 'applied', v_detail = 'refund_retry';
            END IF;
            LEAVE main;
        END IF;

        -- refund.succeeded
        IF v_r_status = 'succeeded' THEN
            SET v_detail = 'already_refunded';
            LEAVE main;
        END IF;
        IF p_currency IS NULL OR p_currency <> v_p_currency OR p_amount IS NULL
           OR p_amount <> v_r_amount OR p_amount > v_p_amount - v_p_refunded
           OR v_refunded + p_amount > v_paid THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'refund_mismatch';
            LEAVE main;
        END IF;
        UPDATE payment_refunds
           SET status = 'succeeded', provider_refund_id = p_refund_id, settled_at = v_now,
               updated_at = v_now
         WHERE id = v_r_id;
        UPDATE payments SET refunded_amount = refunded_amount + p_amount, updated_at = v_now
         WHERE provider = p_provider AND payment_id = p_payment_id;
        UPDATE orders SET refunded_amount = refunded_amount + p_amount, updated_at = v_now,
               version = version + 1
         WHERE id = p_order_id;
        SET v_refunded = v_refunded + p_amount;
        SET v_code = 0, v_outcome = 'applied', v_detail = 'refunded';
        IF v_status = 'REFUND_PENDING' AND v_refunded >= v_paid THEN
            UPDATE orders SET status = 'REFUNDED', closed_at = v_now, updated_at = v_now
             WHERE id = p_order_id;
            SET v_status = 'REFUNDED', v_topic = 'order.refunded';
        END IF;
    END main;

    IF v_code = 3 THEN
        SET v_topic = 'payment.quarantined';
    END IF;
    IF v_topic IS NOT NULL THEN
        INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at)
        VALUES (p_tx_id, v_topic, COALESCE(p_order_id, LEFT(p_payment_id, 64), p_event_id),
            JSON_OBJECT('order_id', p_order_id, 'deal_id', IF(v_has_order, v_deal + 0, NULL),
                        'user_id', IF(v_has_order, v_user + 0, NULL),
                        'quantity', IF(v_has_order, v_qty + 0, NULL),
                        'status', v_status, 'provider', p_provider, 'payment_id', p_payment_id,
                        'refund_id', p_refund_id, 'amount', p_amount + 0, 'currency', p_currency,
                        'event_id', p_event_id, 'event_type', p_type, 'detail', v_detail,
                        'at', DATE_FORMAT(v_now, '%Y-%m-%dT%H:%i:%s.%fZ')),
            v_now);
    END IF;
    UPDATE payment_events
       SET outcome = v_outcome, detail = v_detail,
           processed_at = IF(v_code IN (4, 5), NULL, v_now)
     WHERE provider = p_provider AND event_id = p_event_id;
    IF v_has_order = 1 AND v_code IN (0, 4) THEN
        SELECT COUNT(*) INTO v_waiting FROM payment_events
         WHERE order_id = p_order_id AND outcome = 'waiting';
    END IF;
    SET o_code = v_code, o_outcome = v_outcome, o_detail = v_detail, o_status = v_status,
        o_deal = v_deal, o_waiting = v_waiting, o_capture = v_capture;
END$$

-- Record one provider event and apply it, in one transaction (the interface of 003).
--   p_mode 0: a new event (inserted; a duplicate stops here)
--   p_mode 1: re-run an event recorded as waiting (its payment may be known now)
-- Returns one row: code, outcome, detail, order status after, deal id, waiting
-- events of the order, capture (1: an authorization now waits for its capture).
CREATE PROCEDURE gate_payment_event(
    IN p_mode        TINYINT,
    IN p_provider    VARCHAR(32) CHARACTER SET ascii,
    IN p_event_id    VARCHAR(191) CHARACTER SET ascii,
    IN p_type        VARCHAR(64) CHARACTER SET ascii,
    IN p_order_id    CHAR(26) CHARACTER SET ascii,
    IN p_payment_id  VARCHAR(191) CHARACTER SET ascii,
    IN p_amount      BIGINT UNSIGNED,
    IN p_currency    CHAR(3) CHARACTER SET ascii,
    IN p_refund_id   VARCHAR(191) CHARACTER SET ascii,
    IN p_payload     MEDIUMTEXT,
    IN p_created     DATETIME(6),
    IN p_tx_id       CHAR(26) CHARACTER SET ascii,
    IN p_actor       VARCHAR(64))
SQL SECURITY INVOKER
BEGIN
    DECLARE v_code     INT;
    DECLARE v_outcome  VARCHAR(32) CHARACTER SET ascii;
    DECLARE v_detail   VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_status   VARCHAR(20) CHARACTER SET ascii;
    DECLARE v_deal     BIGINT UNSIGNED;
    DECLARE v_waiting  INT;
    DECLARE v_capture  INT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    START TRANSACTION;
    CALL gate_payment_event_in_tx(p_mode, p_provider, p_event_id, p_type, p_order_id,
        p_payment_id, p_amount, p_currency, p_refund_id, p_payload, p_created, p_tx_id,
        p_actor, v_code, v_outcome, v_detail, v_status, v_deal, v_waiting, v_capture);
    IF v_code = 1 THEN
        ROLLBACK;
    ELSE
        COMMIT;
    END IF;
    SELECT v_code AS code, v_outcome AS outcome, v_detail AS detail, v_status AS status,
           v_deal AS deal_id, v_waiting AS waiting, v_capture AS capture;
END$$

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
CREATE PROCEDURE gate_payment_event_group(
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

-- The session's scratch tables for gate_payment_event_group, created on first use
-- and emptied before each group. Temporary tables are private to the connection.
CREATE PROCEDURE gate_cb_scratch()
SQL SECURITY INVOKER
BEGIN
    -- Already there: nothing to create (the handled error leaves no warning).
    DECLARE CONTINUE HANDLER FOR 1050 BEGIN END;
    CREATE TEMPORARY TABLE gate_cb_events (
        n           INT UNSIGNED NOT NULL,
        event_id    VARCHAR(191) CHARACTER SET ascii NULL,
        event_type  VARCHAR(64) CHARACTER SET ascii NULL,
        order_id    CHAR(26) CHARACTER SET ascii NULL,
        payment_id  VARCHAR(191) CHARACTER SET ascii NULL,
        amount      BIGINT UNSIGNED NULL,
        currency    CHAR(3) CHARACTER SET ascii NULL,
        refund_id   VARCHAR(191) CHARACTER SET ascii NULL,
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
