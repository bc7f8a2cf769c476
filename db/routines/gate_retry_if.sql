-- Routine gate_retry_if (introduced by 003_payments.sql; kept once, here).
-- `gate migrate` re-applies this file (CREATE OR REPLACE) whenever its checksum
-- changes; see docs/migrations.md.
--
-- Part of the payment event logic (gate_payment_event_in_tx).

DELIMITER $$

-- Events of one payment serialize on their order's row; a row inserted concurrently
-- under another order id (a provider bug or a forged order id) shows up as a
-- duplicate key: run the whole transaction again, it will see the row.
CREATE OR REPLACE PROCEDURE gate_retry_if(IN p_flag INT)
SQL SECURITY INVOKER
BEGIN
    IF p_flag = 1 THEN
        SIGNAL SQLSTATE '40001'
            SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'gate: concurrent payment row; retry';
    END IF;
END$$

DELIMITER ;
