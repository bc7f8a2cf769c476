-- Gate, version 30: queue mode (docs/queue-mode.md).
--
-- Schema only: a deal's selling mode ('sync', today's path, or 'queue': admitted in
-- Redis, answered 202, committed in the background by gate/queuemode/consumer.py through
-- gate_reserve_group), and the dead letters of queued requests whose commit failed
-- GATE_QUEUE_ATTEMPTS_MAX times (their units were given back; a person decides).
-- No routine changes: the queue commits through the existing procedures.

ALTER TABLE deals
    ADD COLUMN IF NOT EXISTS mode ENUM('sync', 'queue') CHARACTER SET ascii NOT NULL
        DEFAULT 'sync';

CREATE TABLE IF NOT EXISTS queue_dead_letters (
    id               BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,
    -- The queued request's order id (its in-flight token): one dead letter per request.
    order_id         CHAR(26) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    deal_id          BIGINT UNSIGNED NOT NULL,
    user_id          BIGINT UNSIGNED NOT NULL,
    quantity         INT UNSIGNED NOT NULL,
    idempotency_key  VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    attempts         INT UNSIGNED NOT NULL,
    last_error       VARCHAR(500) NOT NULL,
    -- NULL until `gate queue retry` re-submitted it; then the new order id.
    retried_order_id CHAR(26) CHARACTER SET ascii COLLATE ascii_bin NULL,
    created_at       DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    retried_at       DATETIME(6) NULL,
    UNIQUE KEY uq_qdl_order (order_id),
    KEY ix_qdl_deal (deal_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
