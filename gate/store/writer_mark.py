"""The writer mark: which node the gate processes of a cluster write to, as one row
of the gate's database, so that a process that starts learns it from the cluster.

    writer_mark (db/075_writer_mark.sql), one row:
      node      host:port, as GATE_MYSQL_URL names the node
      server    who answered there (wsrep_node_name or hostname:port, server_id)
      since     when the writes moved there (the database's clock)
      moved_by  the process that moved them (host, pid)

    each probe of a node also reads the row there (read_mark) ──> the freshest mark
    among the usable nodes' answers (freshest) ──> the node of this process's list
    it names (marked_node): the writer rule treats it as the writer already
    (gate/store/dbwriter.py)
    a process whose rule chooses another node than the mark names writes the mark
    on the node it chose (write_mark)

The row is written through the node the writes go to, and Galera replicates it to
every node like any other write, so every Synced node answers the same mark (one
that lags answers an older one, and the freshest wins). Processes that move at about
the same time move to the same node and write the same row there: no certification
conflict between them; a rarer conflict (two processes choosing two nodes at once)
fails one write, whose process follows the mark at its next probe. Without the table
(a database not migrated yet) there is no mark and the rule is the one without it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pymysql

from gate.base.settings import MysqlNode, node_name

log = logging.getLogger("gate.dbwriter")

MARK_TABLE = "writer_mark"
# Errors from the client side (2000 and up: the connection) are the probe's; a server
# error (no such table, database or grant) only means there is no mark to read.
_CLIENT_ERRNO_MIN = 2000
_MOVED_BY = f"{socket.gethostname()[:120]} pid {os.getpid()}"


@dataclass(frozen=True)
class WriterMark:
    node: str
    server: str
    since: datetime
    moved_by: str


def server_error(exc: BaseException) -> bool:
    """An error the server answered (the connection is fine)."""
    if not isinstance(exc, pymysql.err.MySQLError) or not exc.args:
        return False
    code = exc.args[0]
    return isinstance(code, int) and code < _CLIENT_ERRNO_MIN


async def read_mark(conn: Any, database: str) -> tuple[bool, WriterMark | None]:
    """(whether this node has the mark's table, the mark as this node has it)."""
    try:
        async with conn.cursor() as cur:
            await cur.execute(
                f"SELECT node, server, since, moved_by FROM `{database}`.{MARK_TABLE} WHERE id = 1"
            )
            row = await cur.fetchone()
    except pymysql.err.MySQLError as exc:
        if not server_error(exc):
            raise
        return False, None
    if row is None:
        return True, None
    return True, WriterMark(str(row[0]), str(row[1]), row[2], str(row[3]))


async def write_mark(conn: Any, database: str, node: MysqlNode, server: str) -> None:
    """Name `node` the writer, through `conn` (a connection to that node). Writing the
    node already named keeps its `since`."""
    # MariaDB applies the assignments in order: `node` last, so that the IF()s
    # before it compare with the row's former node.
    async with conn.cursor() as cur:
        await cur.execute(
            f"INSERT INTO `{database}`.{MARK_TABLE} (id, node, server, since, moved_by)"
            " VALUES (1, %s, %s, NOW(6), %s) ON DUPLICATE KEY UPDATE"
            " since = IF(node = VALUES(node), since, VALUES(since)),"
            " moved_by = IF(node = VALUES(node), moved_by, VALUES(moved_by)),"
            " server = VALUES(server), node = VALUES(node)",
            (node_name(node), server[:300], _MOVED_BY),
        )


def freshest(marks: Iterable[WriterMark | None]) -> WriterMark | None:
    """The latest move among the marks the usable nodes answered."""
    found = [m for m in marks if m is not None]
    return max(found, key=lambda m: m.since) if found else None


def marked_node(
    mark: WriterMark | None, nodes: Iterable[MysqlNode], servers: Mapping[MysqlNode, str]
) -> MysqlNode | None:
    """The node of this process's list the mark names: by host:port, else by the
    server that answered there (a list that names the nodes differently)."""
    if mark is None:
        return None
    listed = list(nodes)
    for node in listed:
        if node_name(node) == mark.node:
            return node
    for node in listed:
        if servers.get(node) and servers.get(node) == mark.server:
            return node
    return None
