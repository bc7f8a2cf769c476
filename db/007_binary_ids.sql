-- Gate, version 7: identifiers compare exactly.
--
-- Idempotency keys, provider event ids, payment ids, session ids and refund ids are
-- case-sensitive, as they are in Redis (whose keys are bytes) and at the provider.
-- Declared `CHARACTER SET ascii` alone they took ascii_general_ci, where 'Key-A' and
-- 'key-a' are one value: a second buyer key differing only by case hit the first
-- order's unique key and was answered with the first order; an event id differing
-- only by case was taken for a duplicate. Here each becomes ascii_bin, definitions
-- otherwise unchanged. ascii_bin is finer than ascii_general_ci, so no unique key can
-- fail on existing rows.
--
-- Schema only. The procedures keep their `CHARACTER SET ascii` parameters and locals:
-- comparing such a value (implicit, ascii_general_ci) with an ascii_bin column of
-- the same coercibility is done in ascii_bin, MariaDB's rule for mixing a _bin and a
-- _ci collation of one character set, and the column's index is used (an equality on
-- the key: `const` in EXPLAIN). tests/reserve/test_idempotency.py and
-- tests/payments/test_payments_flow.py hold both to it.
--
-- Safe to run twice (every MODIFY restates the same definition) and, through
-- gate.migrate's named lock, concurrently. Each ALTER rebuilds its table.

ALTER TABLE orders
    MODIFY idempotency_key     VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    MODIFY provider_session_id VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
    MODIFY provider_payment_id VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
    MODIFY provider_refund_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL;

ALTER TABLE payment_events
    MODIFY event_id    VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    MODIFY payment_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL,
    MODIFY refund_id   VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL;

ALTER TABLE payment_sessions
    MODIFY session_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NOT NULL;

ALTER TABLE payments
    MODIFY payment_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NOT NULL;

ALTER TABLE payment_refunds
    MODIFY payment_id          VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    MODIFY provider_refund_id  VARCHAR(191) CHARACTER SET ascii COLLATE ascii_bin NULL;
