-- Routine gate_payment_event (introduced by 005_callbacks.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Payment callbacks applied one at a time or in groups (docs/benchmarks-callbacks.md);
-- the event logic itself is gate_payment_event_in_tx (its codes are listed there).

DELIMITER $$

-- Record one provider event and apply it, in one transaction (the interface of 003).
--   p_mode 0: a new event (inserted; a duplicate stops here)
--   p_mode 1: re-run an event recorded as waiting (its payment may be known now)
-- Returns one row: code, outcome, detail, order status after, deal id, waiting
-- events of the order, capture (1: an authorization now waits for its capture).
CREATE OR REPLACE PROCEDURE gate_payment_event(
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
BEGIN
    DECLARE v_code     INT;
    DECLARE v_outcome  VARCHAR(32) CHARACTER SET ascii;
    DECLARE v_detail   VARCHAR(64) CHARACTER SET ascii;
    DECLARE v_status   VARCHAR(20) CHARACTER SET ascii;
    DECLARE v_deal     BIGINT UNSIGNED;
    DECLARE v_waiting  INT;
    DECLARE v_capture  INT;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;

    START TRANSACTION;
    CALL gate_payment_event_in_tx(p_mode, p_provider, p_event_id, p_type, p_order_id,
        p_payment_id, p_amount, p_currency, p_refund_id, p_payload, p_created, p_tx_id,
        p_actor, v_code, v_outcome, v_detail, v_status, v_deal, v_waiting, v_capture);
    IF v_code = 1 THEN
        ROLLBACK;
    ELSE
        COMMIT;
    END IF;
    SELECT v_code AS code, v_outcome AS outcome, v_detail AS detail, v_status AS status,
           v_deal AS deal_id, v_waiting AS waiting, v_capture AS capture;
END$$

DELIMITER ;
