"""The peer baseline: a DB-only reservation gate written the way article 000 writes it.

No Redis in front, one stock row per deal, and the reservation as the article's
statements sent one by one from Python inside one transaction:

    START TRANSACTION
    SELECT … FROM orders WHERE user_id = ? AND idempotency_key = ?   (replay?)
    UPDATE deals SET stock_available = stock_available - q
        WHERE id = ? AND stock_available >= q                         (1 row, or sold out)
    INSERT INTO orders …
    COMMIT

It runs on the gate's stack (Starlette on uvicorn with uvloop and httptools, the
gate's aiomysql pool and session settings, orjson, the gate's JWT verification with
its token cache) and answers the gate's reservation request shape, so one load
generator drives both and the comparison measures the architecture, not the stack.
"""
