-- The peer baseline's schema: article 000's tables, in a database of its own.
-- Statements are separated by lines holding only ";;" so the loader can send them
-- one at a time. Every statement is safe to run again.

CREATE TABLE IF NOT EXISTS deals (
    id               BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    title            VARCHAR(200) NOT NULL,
    unit_price       BIGINT UNSIGNED NOT NULL,
    currency         CHAR(3) CHARACTER SET ascii NOT NULL,
    hold_seconds     INT UNSIGNED NOT NULL DEFAULT 600,
    max_per_order    INT UNSIGNED NOT NULL DEFAULT 1,
    -- Not read by the reservation; the checker needs the initial stock to prove
    -- that nothing was oversold or lost.
    stock_total      INT UNSIGNED NOT NULL,
    stock_available  INT UNSIGNED NOT NULL,
    sold_count       INT UNSIGNED NOT NULL DEFAULT 0,
    updated_at       DATETIME NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT chk_stock_available CHECK (stock_available >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4
;;
CREATE TABLE IF NOT EXISTS orders (
    id               CHAR(26) CHARACTER SET ascii NOT NULL,
    user_id          BIGINT UNSIGNED NOT NULL,
    deal_id          BIGINT UNSIGNED NOT NULL,
    quantity         INT UNSIGNED NOT NULL,
    amount           BIGINT UNSIGNED NOT NULL,
    currency         CHAR(3) CHARACTER SET ascii NOT NULL,
    status           VARCHAR(20) CHARACTER SET ascii NOT NULL,
    idempotency_key  VARCHAR(255) CHARACTER SET ascii NOT NULL,
    expires_at       DATETIME NOT NULL,
    created_at       DATETIME(6) NOT NULL,
    updated_at       DATETIME(6) NOT NULL,
    PRIMARY KEY (id),
    UNIQUE KEY uq_orders_user_idempotency (user_id, idempotency_key),
    KEY ix_orders_deal_status (deal_id, status)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4
