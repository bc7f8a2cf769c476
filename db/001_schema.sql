-- Gate schema, version 1.
--
-- Every stock number lives in deal_buckets; each bucket row balances on its own
-- (total = available + held + sold), enforced by a CHECK so that no statement can
-- ever commit a row that breaks the invariant. Every change to a bucket row is
-- mirrored by one inventory_ledger row carrying the deltas, so the ledger sums
-- always equal the counters (gate check verifies both).
--
-- Times are DATETIME(6) in UTC: the gate sets time_zone = '+00:00' on every
-- connection and judges expiry with the database's NOW(6) only.

CREATE TABLE deals (
    id              BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    title           VARCHAR(200) NOT NULL,
    unit_price      BIGINT UNSIGNED NOT NULL,
    currency        CHAR(3) CHARACTER SET ascii NOT NULL,
    bucket_count    SMALLINT UNSIGNED NOT NULL,
    -- Bumped by every rebucketing; bucket rows carry the epoch they belong to so a
    -- transaction that read the old layout cannot write into the new one.
    layout_epoch    INT UNSIGNED NOT NULL DEFAULT 0,
    hold_seconds    INT UNSIGNED NOT NULL,
    per_user_limit  INT UNSIGNED NULL,
    max_per_order   INT UNSIGNED NOT NULL,
    capture_mode    VARCHAR(16) CHARACTER SET ascii NOT NULL DEFAULT 'automatic',
    starts_at       DATETIME(6) NULL,
    ends_at         DATETIME(6) NULL,
    created_at      DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at      DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    version         INT UNSIGNED NOT NULL DEFAULT 0,
    PRIMARY KEY (id),
    CONSTRAINT deals_bucket_count CHECK (bucket_count BETWEEN 1 AND 1024),
    CONSTRAINT deals_max_per_order CHECK (max_per_order >= 1),
    CONSTRAINT deals_per_user_limit CHECK (per_user_limit IS NULL OR per_user_limit >= 1),
    CONSTRAINT deals_hold_seconds CHECK (hold_seconds >= 1),
    CONSTRAINT deals_capture_mode CHECK (capture_mode IN ('automatic', 'manual')),
    CONSTRAINT deals_window CHECK (starts_at IS NULL OR ends_at IS NULL OR ends_at > starts_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE deal_buckets (
    deal_id     BIGINT UNSIGNED NOT NULL,
    bucket      SMALLINT UNSIGNED NOT NULL,
    epoch       INT UNSIGNED NOT NULL,
    total       BIGINT UNSIGNED NOT NULL,
    available   BIGINT UNSIGNED NOT NULL,
    held        BIGINT UNSIGNED NOT NULL DEFAULT 0,
    sold        BIGINT UNSIGNED NOT NULL DEFAULT 0,
    updated_at  DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (deal_id, bucket),
    CONSTRAINT bucket_available_nonneg CHECK (available >= 0),
    CONSTRAINT bucket_balanced CHECK (total = available + held + sold)
) ENGINE = InnoDB;

CREATE TABLE orders (
    id                   CHAR(26) CHARACTER SET ascii NOT NULL,
    deal_id              BIGINT UNSIGNED NOT NULL,
    user_id              BIGINT UNSIGNED NOT NULL,
    quantity             INT UNSIGNED NOT NULL,
    unit_price           BIGINT UNSIGNED NOT NULL,
    amount               BIGINT UNSIGNED NOT NULL,
    currency             CHAR(3) CHARACTER SET ascii NOT NULL,
    title                VARCHAR(200) NOT NULL,
    status               VARCHAR(20) CHARACTER SET ascii NOT NULL,
    -- Where the held units sit: "bucket:qty[,bucket:qty…]". Bucket numbers map onto
    -- the deal's current layout as bucket MOD bucket_count (see docs/design.md).
    alloc                VARCHAR(255) CHARACTER SET ascii NOT NULL,
    idempotency_key      VARCHAR(255) CHARACTER SET ascii NOT NULL,
    request_fingerprint  CHAR(32) CHARACTER SET ascii NOT NULL,
    capture_mode         VARCHAR(16) CHARACTER SET ascii NOT NULL DEFAULT 'automatic',
    expires_at           DATETIME(6) NOT NULL,
    provider             VARCHAR(32) CHARACTER SET ascii NULL,
    provider_session_id  VARCHAR(191) CHARACTER SET ascii NULL,
    provider_payment_id  VARCHAR(191) CHARACTER SET ascii NULL,
    provider_refund_id   VARCHAR(191) CHARACTER SET ascii NULL,
    paid_amount          BIGINT UNSIGNED NOT NULL DEFAULT 0,
    refunded_amount      BIGINT UNSIGNED NOT NULL DEFAULT 0,
    created_at           DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at           DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    authorized_at        DATETIME(6) NULL,
    paid_at              DATETIME(6) NULL,
    closed_at            DATETIME(6) NULL,
    version              INT UNSIGNED NOT NULL DEFAULT 0,
    PRIMARY KEY (id),
    UNIQUE KEY uq_orders_user_idempotency (user_id, idempotency_key),
    KEY ix_orders_due (status, expires_at),
    KEY ix_orders_deal_status (deal_id, status),
    CONSTRAINT orders_status CHECK (status IN ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID',
        'EXPIRED', 'CANCELLED', 'REFUND_PENDING', 'REFUNDED')),
    CONSTRAINT orders_quantity CHECK (quantity >= 1),
    CONSTRAINT orders_amount CHECK (amount = unit_price * quantity),
    CONSTRAINT orders_refund_bound CHECK (refunded_amount <= paid_amount)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

CREATE TABLE user_quota (
    deal_id  BIGINT UNSIGNED NOT NULL,
    user_id  BIGINT UNSIGNED NOT NULL,
    units    INT UNSIGNED NOT NULL,
    PRIMARY KEY (deal_id, user_id)
) ENGINE = InnoDB;

CREATE TABLE inventory_ledger (
    id                BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    deal_id           BIGINT UNSIGNED NOT NULL,
    bucket            SMALLINT UNSIGNED NOT NULL,
    order_id          CHAR(26) CHARACTER SET ascii NULL,
    -- The operation that Redis mirrors (a reservation's order id, a release's or an
    -- adjustment's intent id): its presence here is how a snapshot knows whether
    -- the operation committed (see docs/redis-mirror.md).
    op_id             CHAR(26) CHARACTER SET ascii NULL,
    d_total           BIGINT NOT NULL,
    d_available       BIGINT NOT NULL,
    d_held            BIGINT NOT NULL,
    d_sold            BIGINT NOT NULL,
    available_before  BIGINT UNSIGNED NOT NULL,
    available_after   BIGINT UNSIGNED NOT NULL,
    reason            VARCHAR(32) CHARACTER SET ascii NOT NULL,
    actor             VARCHAR(64) NOT NULL,
    note              VARCHAR(255) NULL,
    created_at        DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (id),
    KEY ix_ledger_deal (deal_id, id),
    KEY ix_ledger_order (order_id),
    KEY ix_ledger_op (op_id)
) ENGINE = InnoDB;

CREATE TABLE payment_events (
    provider      VARCHAR(32) CHARACTER SET ascii NOT NULL,
    event_id      VARCHAR(191) CHARACTER SET ascii NOT NULL,
    event_type    VARCHAR(64) CHARACTER SET ascii NOT NULL,
    order_id      CHAR(26) CHARACTER SET ascii NULL,
    payment_id    VARCHAR(191) CHARACTER SET ascii NULL,
    amount        BIGINT NULL,
    currency      CHAR(3) CHARACTER SET ascii NULL,
    payload       MEDIUMTEXT NOT NULL,
    outcome       VARCHAR(32) CHARACTER SET ascii NOT NULL DEFAULT 'received',
    received_at   DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    processed_at  DATETIME(6) NULL,
    PRIMARY KEY (provider, event_id),
    KEY ix_payment_events_order (order_id),
    KEY ix_payment_events_outcome (outcome, received_at)
) ENGINE = InnoDB;

CREATE TABLE outbox (
    id            BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    event_id      CHAR(26) CHARACTER SET ascii NOT NULL,
    topic         VARCHAR(64) CHARACTER SET ascii NOT NULL,
    aggregate_id  VARCHAR(64) CHARACTER SET ascii NOT NULL,
    payload       TEXT NOT NULL,
    created_at    DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    published_at  DATETIME(6) NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uq_outbox_event (event_id),
    KEY ix_outbox_unpublished (published_at, id)
) ENGINE = InnoDB;
