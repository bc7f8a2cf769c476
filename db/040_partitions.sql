-- Gate, version 40: deal partitions (docs/scale-out.md).
--
-- A hot deal may be spread over P Redis hash tags ("partitions"); partition k owns
-- the buckets b with b MOD P = k. P is fixed when the deal is created (1 for every
-- existing deal: their behaviour is unchanged). gate_reserve reads it to keep its
-- fall-over inside the partition whose bucket Redis chose (db/routines/gate_reserve.sql).

ALTER TABLE deals
    ADD COLUMN IF NOT EXISTS partitions TINYINT UNSIGNED NOT NULL DEFAULT 1;

ALTER TABLE deals
    ADD CONSTRAINT IF NOT EXISTS deals_partitions
        CHECK (partitions BETWEEN 1 AND 16 AND partitions <= bucket_count);
