-- Gate payments, version 3: provider sessions, payments, refunds and the payment
-- event state machine (docs/payments.md).
--
-- Every provider fact (a verified webhook, or an API answer turned into a synthetic
-- event with a deterministic id) is applied by gate_payment_event in one short
-- transaction: the event row (primary key provider + event id) is inserted first, so
-- a duplicate stops at the key before anything else happens, and the transition it
-- causes commits together with its ledger and outbox rows.
--
-- Result codes of gate_payment_event (mirrored by gate.payments.codes.EventCode):
--   0 APPLIED      a transition or a recorded fact
--   1 DUPLICATE    the event was already recorded (or is no longer waiting)
--   2 IGNORED      recorded, no effect (a failure after a success, a stale fact)
--   3 QUARANTINED  recorded, never applied: wrong amount, currency or order
--   4 LATE         a success after the hold ended: the caller settles it (re-take or refund)
--   5 WAITING      recorded; it waits for its payment (a refund before its payment)

ALTER TABLE payment_events
    ADD COLUMN refund_id VARCHAR(191) CHARACTER SET ascii NULL AFTER payment_id,
    ADD COLUMN detail VARCHAR(64) CHARACTER SET ascii NULL AFTER outcome,
    ADD COLUMN event_created_at DATETIME(6) NULL AFTER detail,
    ADD KEY ix_payment_events_payment (provider, payment_id);

-- One provider checkout session per order, created after the hold committed.
CREATE TABLE payment_sessions (
    order_id      CHAR(26) CHARACTER SET ascii NOT NULL,
    provider      VARCHAR(32) CHARACTER SET ascii NOT NULL,
    session_id    VARCHAR(191) CHARACTER SET ascii NOT NULL,
    redirect_url  VARCHAR(1024) NOT NULL,
    expires_at    DATETIME(6) NULL,
    created_at    DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (order_id),
    UNIQUE KEY uq_payment_sessions_session (provider, session_id)
) ENGINE = InnoDB;

-- What the gate knows of each provider payment. Statuses only move forward:
-- failed -> authorized -> succeeded, authorized -> voided.
-- next_action_at schedules the capture or the void of an authorization.
CREATE TABLE payments (
    provider          VARCHAR(32) CHARACTER SET ascii NOT NULL,
    payment_id        VARCHAR(191) CHARACTER SET ascii NOT NULL,
    order_id          CHAR(26) CHARACTER SET ascii NULL,
    amount            BIGINT UNSIGNED NOT NULL,
    currency          CHAR(3) CHARACTER SET ascii NOT NULL,
    status            VARCHAR(16) CHARACTER SET ascii NOT NULL,
    refunded_amount   BIGINT UNSIGNED NOT NULL DEFAULT 0,
    action_attempts   INT UNSIGNED NOT NULL DEFAULT 0,
    next_action_at    DATETIME(6) NULL,
    last_error        VARCHAR(255) NULL,
    created_at        DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at        DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (provider, payment_id),
    KEY ix_payments_order (order_id),
    KEY ix_payments_action (status, next_action_at),
    CONSTRAINT payments_status CHECK (status IN ('failed', 'authorized', 'succeeded', 'voided')),
    CONSTRAINT payments_refund_bound CHECK (refunded_amount <= amount)
) ENGINE = InnoDB;

-- The gate refunds each captured payment it cannot honour once, in full. The
-- provider idempotency key is derived from (provider, payment, generation): a retry
-- of the same attempt reuses it; only a refund the provider declined moves to the
-- next generation.
CREATE TABLE payment_refunds (
    id                  BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    provider            VARCHAR(32) CHARACTER SET ascii NOT NULL,
    payment_id          VARCHAR(191) CHARACTER SET ascii NOT NULL,
    order_id            CHAR(26) CHARACTER SET ascii NOT NULL,
    amount              BIGINT UNSIGNED NOT NULL,
    currency            CHAR(3) CHARACTER SET ascii NOT NULL,
    status              VARCHAR(16) CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    generation          INT UNSIGNED NOT NULL DEFAULT 0,
    provider_refund_id  VARCHAR(191) CHARACTER SET ascii NULL,
    attempts            INT UNSIGNED NOT NULL DEFAULT 0,
    next_attempt_at     DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_error          VARCHAR(255) NULL,
    reason              VARCHAR(32) CHARACTER SET ascii NOT NULL,
    created_at          DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at          DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    settled_at          DATETIME(6) NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uq_refunds_payment (provider, payment_id),
    UNIQUE KEY uq_refunds_provider_id (provider, provider_refund_id),
    KEY ix_refunds_due (status, next_attempt_at),
    KEY ix_refunds_order (order_id),
    CONSTRAINT refunds_status CHECK (status IN ('pending', 'submitted', 'succeeded'))
) ENGINE = InnoDB;

DELIMITER $$

-- Events of one payment serialize on their order's row; a row inserted concurrently
-- under another order id (a provider bug or a forged order id) shows up as a
-- duplicate key: run the whole transaction again, it will see the row.
CREATE PROCEDURE gate_retry_if(IN p_flag INT)
SQL SECURITY INVOKER
BEGIN
    IF p_flag = 1 THEN
        SIGNAL SQLSTATE '40001'
            SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: concurrent payment row; retry';
    END IF;
END$$

-- Move an order's held units to sold on the buckets its allocation names, with one
-- ledger row per bucket. Part of the caller's transaction; the order row is locked.
CREATE PROCEDURE gate_sell_held(
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

-- Record one provider event and apply it, in one transaction.
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
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    START TRANSACTION;
    SET v_now = NOW(6);
    IF p_mode = 0 THEN
        INSERT INTO payment_events (provider, event_id, event_type, order_id, payment_id,
            refund_id, amount, currency, payload, outcome, event_created_at, received_at)
        VALUES (p_provider, p_event_id, p_type, p_order_id, p_payment_id, p_refund_id,
            p_amount, p_currency, p_payload, 'received', p_created, v_now);
        IF v_dup = 1 THEN
            ROLLBACK;
            SELECT 1 AS code, 'duplicate' AS outcome, NULL AS detail, NULL AS status,
                   0 AS deal_id, 0 AS waiting, 0 AS capture;
            LEAVE proc;
        END IF;
    ELSE
        SET v_found = 1;
        SELECT outcome INTO v_prev FROM payment_events
         WHERE provider = p_provider AND event_id = p_event_id FOR UPDATE;
        IF v_found = 0 OR v_prev <> 'waiting' THEN
            ROLLBACK;
            SELECT 1 AS code, 'duplicate' AS outcome, NULL AS detail, NULL AS status,
                   0 AS deal_id, 0 AS waiting, 0 AS capture;
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
    COMMIT;
    SELECT v_code AS code, v_outcome AS outcome, v_detail AS detail, v_status AS status,
           v_deal AS deal_id, v_waiting AS waiting, v_capture AS capture;
END$$

DELIMITER ;
