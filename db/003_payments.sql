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

-- The routines this version introduced live in db/routines/, one file each
-- (gate_retry_if, gate_sell_held, gate_payment_event);
-- `gate migrate` re-applies a routine whenever its file changes (docs/migrations.md).
