-- Gate, version 50: what `gate queue retry` got for a dead letter
-- (docs/queue-mode.md "Dead letters").
--
-- retried_at alone could not tell a retry that ended from one whose command died
-- between its claim and its answer: such a claim stranded the dead letter for good.
-- retried_outcome is written when the re-submission is answered: the new order's
-- status (QUEUED, PENDING_PAYMENT) or the refusal's problem code. A claim with
-- neither an outcome nor an order that is older than a retry can last may be taken
-- over by a later retry (gate/queuemode/cli.py RETRY_CLAIM_SECONDS).

ALTER TABLE queue_dead_letters
    ADD COLUMN IF NOT EXISTS retried_outcome VARCHAR(64) CHARACTER SET ascii NULL
        AFTER retried_order_id;

-- Claims made before this version: a refused retry left no trace but retried_at, so
-- they are marked, not taken over (a person looks; docs/runbooks.md).
UPDATE queue_dead_letters SET retried_outcome = 'UNRECORDED'
    WHERE retried_at IS NOT NULL AND retried_order_id IS NULL AND retried_outcome IS NULL;
