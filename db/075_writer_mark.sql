-- Gate, version 75: the writer mark of a Galera cluster
-- (docs/high-availability.md "One writer").
--
-- One row naming the node every gate process writes to when GATE_MYSQL_URL lists
-- several nodes: written through that node by a process that moves the writes
-- there, replicated to every node like any other write, and read at each probe of
-- each node (gate/store/writer_mark.py), so that a process that starts follows the
-- others instead of judging the nodes without their history. A single server never
-- reads or writes it.

CREATE TABLE IF NOT EXISTS writer_mark (
    id        TINYINT UNSIGNED NOT NULL,
    node      VARCHAR(300) CHARACTER SET ascii NOT NULL,
    server    VARCHAR(300) NOT NULL,
    since     DATETIME(6) NOT NULL,
    moved_by  VARCHAR(200) NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT ck_writer_mark_one_row CHECK (id = 1)
) ENGINE = InnoDB;
