-- Routine gate_payment_event_in_tx (introduced by 005_callbacks.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- A provider payment id belongs to one order and one amount
-- for good: an event naming a known payment with another order (any type) or, for
-- payment.succeeded/authorized, another amount (unless the payment is a failed attempt
-- recorded without one) is quarantined (payment_order_changed, payment_amount_changed)
-- and changes nothing.
--
-- Every provider fact (a verified webhook, or an API answer turned into a synthetic
-- event with a deterministic id) is applied in one short transaction: the event row
-- (primary key provider + event id) is inserted first, so a duplicate stops at the
-- key before anything else happens (docs/payments.md).
-- Result codes (mirrored by gate.payments.codes.EventCode):
--   0 APPLIED      a transition or a recorded fact
--   1 DUPLICATE    the event was already recorded (or is no longer waiting)
--   2 IGNORED      recorded, no effect (a failure after a success, a stale fact)
--   3 QUARANTINED  recorded, never applied: wrong amount, currency or order, or a type
--                  `quarantine.<reason>` an adapter gave an event it cannot read
--   4 LATE         a success after the hold ended: the caller settles it (re-take or refund)
--   5 WAITING      recorded; it waits for its payment (a refund before its payment)

DELIMITER $$

-- One provider event inside the caller's transaction (see 003 for the codes). A
-- duplicate (code 1) writes nothing; the caller decides what to commit.
CREATE OR REPLACE PROCEDURE gate_payment_event_in_tx(
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
    DECLARE v_p_order    CHAR(26) CHARACTER SET ascii;
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
        SELECT status, amount, refunded_amount, currency, order_id
          INTO v_p_status, v_p_amount, v_p_refunded, v_p_currency, v_p_order
          FROM payments WHERE provider = p_provider AND payment_id = p_payment_id FOR UPDATE;
        IF v_found = 0 THEN
            SET v_p_status = NULL;
        END IF;
    END IF;

    main: BEGIN
        IF p_type LIKE 'quarantine.%' THEN
            -- An adapter that cannot read the event safely (a Stripe event rendered at
            -- an API version the adapter does not read) records it with its reason.
            SET v_code = 3, v_outcome = 'quarantined', v_detail = SUBSTRING(p_type, 12);
            LEAVE main;
        END IF;
        IF p_type NOT IN ('payment.succeeded', 'payment.authorized', 'payment.failed',
                          'authorization.voided', 'refund.succeeded', 'refund.failed') THEN
            SET v_detail = 'unknown_type';
            LEAVE main;
        END IF;
        IF p_payment_id IS NULL THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'no_payment_id';
            LEAVE main;
        END IF;
        -- A known payment stays with its order and its amount: an event that says
        -- otherwise would move money between orders.
        IF v_p_status IS NOT NULL AND p_order_id IS NOT NULL
           AND NOT (v_p_order <=> p_order_id) THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'payment_order_changed';
            LEAVE main;
        END IF;
        -- (A failed attempt recorded without an amount holds 0: no amount to keep.)
        IF v_p_status IS NOT NULL AND NOT (v_p_status = 'failed' AND v_p_amount = 0)
           AND p_type IN ('payment.succeeded', 'payment.authorized')
           AND NOT (p_amount <=> v_p_amount) THEN
            SET v_code = 3, v_outcome = 'quarantined', v_detail = 'payment_amount_changed';
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

DELIMITER ;
