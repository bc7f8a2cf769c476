-- Gate, version 70: outbound webhooks (docs/webhooks.md, gate/webhooks/).
--
--   state change ──same transaction──> outbox row (as before: the durable record)
--   fan-out (gate/webhooks/fanout.py), one transaction per batch, in outbox id order:
--       outbox rows with webhooks_at NULL above the floor ──> a webhook_events row
--       each (its per-order sequence from webhook_sequences, its body made once),
--       one webhook_deliveries row per subscribed endpoint, webhooks_at set
--   deal watcher (gate/webhooks/fanout.py) ──one transaction──> a sold-out edge
--       of webhook_deal_state and its webhook_events row
--   sender (gate/webhooks/dispatcher.py) ──claim, POST, one transaction──>
--       webhook_attempts row, the delivery delivered / retried / failed
--
-- Nothing here touches a stored procedure or the sale's transactions: the outbox row
-- every state change already commits is the source. The fan-out marks what it has
-- handled on the row itself (webhooks_at; a cursor alone would skip a row whose id
-- was taken before, and whose transaction committed after, a later one's), and
-- ignores rows at or below webhook_cursor.outbox_floor: the outbox as it stood when
-- webhooks were last switched on (no endpoint enabled before), so a first endpoint is
-- not sent the whole history.

ALTER TABLE outbox ADD COLUMN IF NOT EXISTS webhooks_at DATETIME(6) NULL;
ALTER TABLE outbox ADD KEY IF NOT EXISTS ix_outbox_webhooks (webhooks_at, id);

CREATE TABLE IF NOT EXISTS webhook_cursor (
    name          VARCHAR(32) CHARACTER SET ascii NOT NULL,
    outbox_floor  BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (name)
) ENGINE = InnoDB;
INSERT IGNORE INTO webhook_cursor (name, outbox_floor)
    SELECT 'outbox', COALESCE(MAX(id), 0) FROM outbox;

CREATE TABLE IF NOT EXISTS webhook_endpoints (
    id               CHAR(26) CHARACTER SET ascii NOT NULL,
    url              VARCHAR(2048) CHARACTER SET ascii NOT NULL,
    -- A JSON array of event types, or ["*"].
    events           VARCHAR(1024) CHARACTER SET ascii NOT NULL,
    description      VARCHAR(500) NOT NULL DEFAULT '',
    -- 'deleted' rows stay until their deliveries are purged (gate/webhooks/store.py).
    status           ENUM('enabled', 'disabled', 'deleted') CHARACTER SET ascii NOT NULL
                         DEFAULT 'enabled',
    -- Why it is disabled: 'manual', 'gone' (it answered 410), 'failing' (every
    -- delivery failed for 5 days).
    disabled_reason  VARCHAR(16) CHARACTER SET ascii NULL,
    -- The signing secrets, sealed with GATE_WEBHOOK_ENCRYPTION_KEY
    -- (gate/webhooks/vault.py); the previous one signs too until previous_until.
    secret           VARCHAR(255) CHARACTER SET ascii NOT NULL,
    previous_secret  VARCHAR(255) CHARACTER SET ascii NULL,
    previous_until   DATETIME(6) NULL,
    -- The first failed attempt since the last delivered one (NULL while healthy).
    failing_since    DATETIME(6) NULL,
    last_success_at  DATETIME(6) NULL,
    created_at       DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at       DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (id),
    KEY ix_webhook_endpoints_status (status)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- One row per name, locked to serialise what a count must bound (the endpoints'
-- number at create).
CREATE TABLE IF NOT EXISTS webhook_locks (
    name  VARCHAR(32) CHARACTER SET ascii NOT NULL,
    PRIMARY KEY (name)
) ENGINE = InnoDB;
INSERT IGNORE INTO webhook_locks (name) VALUES ('endpoints');

-- The last sequence number of each order's (or payment's) events, taken by the
-- fan-out in outbox id order: two events of one order lock the order row before
-- writing their outbox rows, so the later one's id is the larger and the earlier is
-- committed by the time the later is seen.
CREATE TABLE IF NOT EXISTS webhook_sequences (
    aggregate_id  VARCHAR(64) CHARACTER SET ascii NOT NULL,
    sequence      BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (aggregate_id)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS webhook_events (
    id             BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    -- The webhook-id: the outbox row's event id, or the deal watcher's / a test's own.
    event_id       VARCHAR(64) CHARACTER SET ascii NOT NULL,
    type           VARCHAR(64) CHARACTER SET ascii NOT NULL,
    aggregate_id   VARCHAR(64) CHARACTER SET ascii NOT NULL,
    sequence       BIGINT UNSIGNED NOT NULL,
    -- The request body, made once so that every attempt sends the same bytes.
    body           TEXT CHARACTER SET utf8mb4 NOT NULL,
    -- A test event goes to this endpoint alone.
    endpoint_id    CHAR(26) CHARACTER SET ascii NULL,
    created_at     DATETIME(6) NOT NULL,
    -- NULL until its deliveries exist (deal events wait here for the fan-out).
    fanned_out_at  DATETIME(6) NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uq_webhook_events_event (event_id),
    KEY ix_webhook_events_pending (fanned_out_at, id),
    KEY ix_webhook_events_created (created_at)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id               BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    endpoint_id      CHAR(26) CHARACTER SET ascii NOT NULL,
    event_row        BIGINT UNSIGNED NOT NULL,
    status           ENUM('pending', 'delivered', 'failed') CHARACTER SET ascii NOT NULL
                         DEFAULT 'pending',
    -- Attempts of the current round (a manual retry starts a new round).
    attempts         SMALLINT UNSIGNED NOT NULL DEFAULT 0,
    -- When the next attempt is due; while an attempt is in flight, when its claim
    -- lapses (its sender died: the delivery is sent again).
    next_attempt_at  DATETIME(6) NOT NULL,
    claim            CHAR(16) CHARACTER SET ascii NULL,
    last_status      SMALLINT UNSIGNED NULL,
    last_error       VARCHAR(255) NULL,
    created_at       DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at       DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    delivered_at     DATETIME(6) NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uq_webhook_deliveries (endpoint_id, event_row),
    KEY ix_webhook_deliveries_due (endpoint_id, status, next_attempt_at),
    KEY ix_webhook_deliveries_list (endpoint_id, status, id),
    KEY ix_webhook_deliveries_age (created_at)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS webhook_attempts (
    id           BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    delivery_id  BIGINT UNSIGNED NOT NULL,
    attempt      SMALLINT UNSIGNED NOT NULL,
    started_at   DATETIME(6) NOT NULL,
    duration_ms  INT UNSIGNED NOT NULL,
    http_status  SMALLINT UNSIGNED NULL,
    error        VARCHAR(255) NULL,
    PRIMARY KEY (id),
    KEY ix_webhook_attempts_delivery (delivery_id, id)
) ENGINE = InnoDB;

-- Attempts and delivered ones per endpoint and hour: the console's success rate
-- without counting attempt rows.
CREATE TABLE IF NOT EXISTS webhook_endpoint_stats (
    endpoint_id  CHAR(26) CHARACTER SET ascii NOT NULL,
    hour         DATETIME NOT NULL,
    attempts     INT UNSIGNED NOT NULL DEFAULT 0,
    delivered    INT UNSIGNED NOT NULL DEFAULT 0,
    PRIMARY KEY (endpoint_id, hour)
) ENGINE = InnoDB;

-- A deal's last seen sold-out state (gate/webhooks/store.py, WebhookStore.deal_edges):
-- deal.sold_out and deal.available_again are edges of it, numbered per deal.
CREATE TABLE IF NOT EXISTS webhook_deal_state (
    deal_id     BIGINT UNSIGNED NOT NULL,
    sold_out    TINYINT(1) NOT NULL,
    sequence    BIGINT UNSIGNED NOT NULL DEFAULT 0,
    changed_at  DATETIME(6) NOT NULL,
    PRIMARY KEY (deal_id)
) ENGINE = InnoDB;
