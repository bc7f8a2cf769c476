"""Which database node takes the writes when GATE_MYSQL_URL names several hosts.

GATE_MYSQL_URL may list the nodes of one synchronous cluster (MariaDB Galera):
`mysql://user:pass@host1:3306,host2:3306,host3:3306/gate`. Every process of every gate
writes to ONE node at a time, chosen by the same rule everywhere, so the cluster sees
one writer (no certification conflicts between gates):

    every GATE_DB_PROBE_INTERVAL_SECONDS (and at once after a connection error)
      probe each node (one kept connection per node, GATE_DB_PROBE_TIMEOUT_SECONDS):
        usable = it answers, read_only = OFF, and where wsrep is on
                 wsrep_cluster_status = Primary, wsrep_desync = OFF,
                 wsrep_local_state = 4 (Synced) and wsrep_ready = ON
        and read the writer mark it has (gate/store/writer_mark.py)
      marked = the node the freshest mark of the usable nodes names, if usable
      writer = the first node in list order that is usable and either
                 is the marked node (without one: is this process's writer already),
                 or has been usable for the hold-down (GATE_DB_WRITER_HOLD_DOWN_SECONDS)
               else the first usable node (a node just back beats no writer)
               else none (the current pool stays; requests get 503 until one is)
      writer changed ──> gate_db_failovers_total + 1, gate_db_writer_info{node} moves,
                         the pool is replaced (gate/store/db.py): connections to the old node
                         are closed as they come back, new ones go to the new node
      writer ≠ marked, and this process moved, or there is no mark, or the writer is
        a node before the marked one that has been usable for the hold-down
                     ──> the mark names the writer (written through it)

The mark is how processes agree without having seen the same history: a process
that starts follows the others to the node they write to, and every process follows
a move another one made (within a probe interval). A node seen for the first time
counts as usable since its server started (its Uptime) when there is no mark or the
mark names it; while the mark names another node, its hold-down starts at first
sight: a process cannot know whether the others hold it down (a node that was
Donor/Desynced or read-only comes back without a restart), and the ones that saw
it fail hand the writes back to it (moving the mark) when their hold-down ends.
A process that cannot use the marked node while the others can (its own network)
moves and marks its new node; the others follow it (one writer still) unless a node
before it in the list has been usable for the hold-down in their view, typically
their own writer: then they stay and mark that node again at their next probe.

A node that refuses connections or answers that it is unusable is dropped within one
probe interval plus one probe timeout (the mark is read within the same timeout). The
writer is dropped for merely not answering in time only when two probes in a row
time out (the second follows the first at once): one late answer, as a load spike on
the gate's host gives, would otherwise move this process alone to another node and
keep it there for the hold-down, two writers for the cluster meanwhile. A dead or
unreachable writer is then dropped within one interval plus two timeouts (3 s with
the defaults, at most 9 s with the bounds the settings allow). A node takes the
writes back only after the hold-down, so a node that flaps does not drag the writers
along with it.

A single host is never probed after start-up (nor is a mark read or written): there
is nowhere to move to. At start
(gate serve, Database.start) every host is probed once and a gate refuses to start
when no listed node is usable (read-only, not Synced, unreachable), naming why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiomysql
from pymysql.constants import CLIENT

from gate.base.metrics import METRICS
from gate.base.settings import MysqlNode, MysqlTarget, Settings, node_name
from gate.base.timeouts import deadline_in
from gate.store.writer_mark import (
    WriterMark,
    freshest,
    marked_node,
    read_mark,
    server_error,
    write_mark,
)

log = logging.getLogger("gate.dbwriter")

WRITER_INFO = METRICS.gauge(
    "gate_db_writer_info",
    "1 for the database node this process writes to (GATE_MYSQL_URL's host:port).",
    ["node"],
    kind="flag",
)
FAILOVERS = METRICS.counter(
    "gate_db_failovers_total", "Times this process moved its writes to another database node."
)

# Galera's wsrep_local_state for a node that is part of the cluster and up to date.
WSREP_SYNCED = 4
# A probe triggered by a connection error runs at most this often.
POKE_MIN_SECONDS = 0.1

_VARIABLES = (
    "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('read_only', 'wsrep_on', 'wsrep_desync',"
    " 'server_id', 'wsrep_node_name', 'hostname', 'port', 'version')"
)
_STATUS = (
    "SHOW GLOBAL STATUS WHERE Variable_name IN ('wsrep_local_state',"
    " 'wsrep_local_state_comment', 'wsrep_cluster_status', 'wsrep_ready',"
    " 'wsrep_incoming_addresses', 'Uptime')"
)


class NoWriter(Exception):
    """No listed node takes writes; the message names each node's reason."""


@dataclass(frozen=True)
class NodeReport:
    """One probe of one node: whether it may take the writes, and who it is."""

    node: MysqlNode
    usable: bool
    reason: str  # "ok", or why not ("read-only", "not Synced (state 2)", "unreachable: …")
    server: str = ""  # who answered: wsrep_node_name or hostname:port, and server_id
    wsrep: bool = False
    uptime_seconds: float = 0.0
    version: str = ""
    members: str = ""  # wsrep_incoming_addresses: the primary component's nodes
    timed_out: bool = False  # unreachable because it did not answer within the timeout
    # The writer mark this node answered (gate/store/writer_mark.py); marked: whether
    # it has the mark's table at all.
    mark: WriterMark | None = None
    marked: bool = False

    @property
    def name(self) -> str:
        return node_name(self.node)


def judge(node: MysqlNode, variables: dict[str, str], status: dict[str, str]) -> NodeReport:
    """A node's verdict from its SHOW GLOBAL VARIABLES / STATUS rows."""
    wsrep = variables.get("wsrep_on", "OFF").upper() == "ON"
    label = variables.get("wsrep_node_name") if wsrep else ""
    label = label or f"{variables.get('hostname', '?')}:{variables.get('port', '?')}"
    server = f"{label} (server_id {variables.get('server_id', '?')})"
    reason = "ok"
    state = status.get("wsrep_local_state", "?")
    if variables.get("read_only", "OFF").upper() not in ("OFF", "0"):
        reason = "read-only"
    elif wsrep and status.get("wsrep_cluster_status", "") != "Primary":
        reason = f"not in the primary component ({status.get('wsrep_cluster_status', '?')})"
    elif wsrep and variables.get("wsrep_desync", "OFF").upper() not in ("OFF", "0"):
        # Desynced by an operator (or a backup tool): it may fall behind the others.
        reason = f"not Synced (wsrep_desync = ON, wsrep_local_state {state})"
    elif wsrep and state != str(WSREP_SYNCED):
        comment = status.get("wsrep_local_state_comment", "")
        reason = f"not Synced ({comment + ', ' if comment else ''}wsrep_local_state {state})"
    elif wsrep and status.get("wsrep_ready", "ON").upper() != "ON":
        reason = "not ready (wsrep_ready = OFF)"
    return NodeReport(
        node=node,
        usable=reason == "ok",
        reason=reason,
        server=server,
        wsrep=wsrep,
        uptime_seconds=float(status.get("Uptime", "0") or 0),
        version=variables.get("version", ""),
        members=status.get("wsrep_incoming_addresses", ""),
    )


def connect_args(target: MysqlTarget, node: MysqlNode, timeout_seconds: float) -> dict[str, Any]:
    """aiomysql.connect's arguments for one node, no database selected."""
    kwargs: dict[str, Any] = {
        "user": target.user,
        "password": target.password.reveal(),
        "connect_timeout": timeout_seconds,
        "autocommit": True,
        "charset": "utf8mb4",
        "client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.MULTI_RESULTS,
    }
    if target.unix_socket:
        kwargs["unix_socket"] = target.unix_socket
    else:
        kwargs["host"], kwargs["port"] = node
    return kwargs


async def ask(conn: Any) -> tuple[dict[str, str], dict[str, str]]:
    async with conn.cursor() as cur:
        await cur.execute(_VARIABLES)
        variables = {str(k).lower(): str(v) for k, v in await cur.fetchall()}
        await cur.execute(_STATUS)
        status = {str(k).lower(): str(v) for k, v in await cur.fetchall()}
    # SHOW STATUS names Uptime with a capital.
    status["Uptime"] = status.pop("uptime", "0")
    return variables, status


async def _verdict(conn: Any, target: MysqlTarget, node: MysqlNode) -> NodeReport:
    """A node's verdict; with several nodes, with the writer mark it answers."""
    variables, status = await ask(conn)
    report = judge(node, variables, status)
    if not target.clustered:
        return report
    marked, mark = await read_mark(conn, target.database)
    return replace(report, mark=mark, marked=marked)


async def probe_once(target: MysqlTarget, node: MysqlNode, timeout_seconds: float) -> NodeReport:
    """One node's verdict on a connection of its own (closed afterwards)."""
    try:
        async with deadline_in(timeout_seconds):
            conn = await aiomysql.connect(**connect_args(target, node, timeout_seconds))
            try:
                return await _verdict(conn, target, node)
            finally:
                conn.close()
    except Exception as exc:
        return NodeReport(node, False, f"unreachable: {_short(exc)}")


def _late(exc: BaseException) -> bool:
    """Whether a probe failed for want of an answer in time (rather than a refusal)."""
    return isinstance(exc, TimeoutError) or "timed out" in str(exc)


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def describe(reports: list[NodeReport]) -> str:
    return "; ".join(f"{r.name} {r.reason}" for r in reports)


def mark_of(reports: list[NodeReport]) -> tuple[WriterMark | None, MysqlNode | None]:
    """The freshest writer mark the usable nodes answered, and the node it names."""
    usable = [r for r in reports if r.usable]
    mark = freshest(r.mark for r in usable)
    return mark, marked_node(mark, [r.node for r in reports], {r.node: r.server for r in usable})


async def first_usable(target: MysqlTarget, timeout_seconds: float) -> tuple[MysqlNode, NodeReport]:
    """The writer for a one-shot tool (gate migrate, gate check, gate serve's start-up
    check): the node the writer mark names when it is usable, else the first usable
    node in list order. NoWriter when there is none."""
    reports = list(
        await asyncio.gather(
            *(probe_once(target, node, timeout_seconds) for node in target.node_list)
        )
    )
    _, marked = mark_of(reports)
    for report in sorted(reports, key=lambda r: r.node != marked):
        if report.usable:
            return report.node, report
    raise NoWriter(f"no database node takes writes: {describe(reports)}")


async def writer_target(target: MysqlTarget, timeout_seconds: float) -> MysqlTarget:
    """`target` on its writer node: itself for a single server (not probed, as
    before), the first usable node of a cluster (NoWriter when none)."""
    if not target.clustered:
        return target
    node, _ = await first_usable(target, timeout_seconds)
    return target.on(node)


def choose(
    nodes: tuple[MysqlNode, ...],
    usable_since: dict[MysqlNode, float | None],
    current: MysqlNode | None,
    now: float,
    hold_down_seconds: float,
) -> MysqlNode | None:
    """The writer rule (see the module docstring); `usable_since` holds when each
    node became usable (monotonic seconds), None while it is not."""
    usable = [n for n in nodes if usable_since.get(n) is not None]
    for node in usable:
        since = usable_since[node]
        assert since is not None
        if node == current or now - since >= hold_down_seconds:
            return node
    return usable[0] if usable else None


WriterChanged = Callable[[MysqlNode | None, MysqlNode, NodeReport], Awaitable[None]]


class WriterSelector:
    """The probe loop of one process: run()/run_once(), poke() after a connection error."""

    def __init__(self, settings: Settings, on_change: WriterChanged) -> None:
        self.target = settings.mysql
        self.nodes = settings.mysql.node_list
        self.interval_seconds = settings.db_probe_interval_seconds
        self.timeout_seconds = settings.db_probe_timeout_seconds
        self.hold_down_seconds = settings.db_writer_hold_down_seconds
        self.on_change = on_change
        self.writer: MysqlNode | None = None
        self.mark: WriterMark | None = None
        self.reports: dict[MysqlNode, NodeReport] = {}
        self.usable_since: dict[MysqlNode, float | None] = {}
        self._conns: dict[MysqlNode, Any] = {}
        self._poked = asyncio.Event()
        # The writer, when its last probe timed out and it was kept (see _note).
        self._late_writer: MysqlNode | None = None
        self._last_run = 0.0
        self._running = asyncio.Lock()

    @property
    def writer_report(self) -> NodeReport | None:
        return self.reports.get(self.writer) if self.writer is not None else None

    async def _probe(self, node: MysqlNode) -> NodeReport:
        """A node's verdict on its kept probe connection (re-opened when it broke)."""
        conn = self._conns.get(node)
        try:
            async with deadline_in(self.timeout_seconds):
                if conn is None or conn.closed:
                    conn = await aiomysql.connect(
                        **connect_args(self.target, node, self.timeout_seconds)
                    )
                    self._conns[node] = conn
                return await _verdict(conn, self.target, node)
        except Exception as exc:
            if conn is not None:
                conn.close()
            self._conns.pop(node, None)
            return NodeReport(node, False, f"unreachable: {_short(exc)}", timed_out=_late(exc))

    async def run_once(self) -> MysqlNode | None:
        """Probe every node, apply the rule; the writer (None: no node is usable)."""
        async with self._running:
            self._last_run = time.monotonic()
            reports = list(await asyncio.gather(*(self._probe(n) for n in self.nodes)))
            now = time.monotonic()
            self.mark, marked = mark_of(reports)
            for report in reports:
                self._note(report, now, marked)
            # The node the mark names counts as the writer already: a process follows
            # the others there, and leaves it only by the rule (it became unusable, or
            # a node before it in the list has been usable for the hold-down).
            current = marked if marked is not None and self.usable_since.get(marked) else None
            chosen = choose(
                self.nodes, self.usable_since, current or self.writer, now, self.hold_down_seconds
            )
            if chosen is None:
                if self.writer is not None:
                    log.error("no database node takes writes: %s", describe(reports))
                return None
            moved = chosen != self.writer
            if moved:
                await self._move(chosen)
            # The mark is written by a process that moves, where there is none yet, and
            # to hand the writes back to a node before the marked one in the list; not
            # by one that merely cannot use the marked node (that could be its own
            # network's fault: the others keep the mark).
            if (
                chosen != marked
                and (moved or self.mark is None or current is not None)
                and any(r.marked for r in reports)
            ):
                await self._mark(chosen)
            return chosen

    async def _mark(self, node: MysqlNode) -> None:
        """Name `node` the writer in the cluster's writer mark (best effort: a process
        that fails to follows the mark of whoever wrote it)."""
        conn = self._conns.get(node)
        if conn is None:
            return
        try:
            async with deadline_in(self.timeout_seconds):
                await write_mark(conn, self.target.database, node, self.reports[node].server)
        except Exception as exc:
            log.info("could not mark %s the database writer: %s", node_name(node), _short(exc))
            if not server_error(exc):
                conn.close()
                self._conns.pop(node, None)

    def _note(self, report: NodeReport, now: float, marked: MysqlNode | None = None) -> None:
        node = report.node
        seen = node in self.usable_since
        self.reports[node] = report
        if report.timed_out and node == self.writer and self._late_writer != node:
            # The first probe of the writer in a row to time out: kept, and probed
            # again at once (run()); a second timeout drops it.
            self._late_writer = node
            self._poked.set()
            log.info("database writer %s did not answer its probe in time", report.name)
            return
        if node == self._late_writer:
            self._late_writer = None
        if not report.usable:
            if self.usable_since.get(node) is not None:
                log.warning("database node %s is unusable: %s", report.name, report.reason)
            self.usable_since[node] = None
        elif self.usable_since.get(node) is None:
            # Back after a failure: now. First sight: since its server started, unless
            # a writer mark names another node (this process cannot know whether
            # others hold this one down: it may have been desynced or read-only
            # without a restart); then its hold-down starts now.
            fresh = not seen and (marked is None or marked == node)
            self.usable_since[node] = now - report.uptime_seconds if fresh else now

    async def _move(self, chosen: MysqlNode) -> None:
        old, report = self.writer, self.reports[chosen]
        await self.on_change(old, chosen, report)
        self.writer = chosen
        for node in self.nodes:
            WRITER_INFO.labels(node_name(node)).set(1 if node == chosen else 0)
        if old is not None:
            FAILOVERS.inc()
            log.warning(
                "database writes move from %s to %s (%s); nodes: %s",
                node_name(old),
                report.name,
                report.server,
                describe(list(self.reports.values())),
            )
        else:
            log.info("database writes go to %s (%s)", report.name, report.server)

    def poke(self) -> None:
        """Probe again soon: a pooled connection failed (bounded: POKE_MIN_SECONDS)."""
        self._poked.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Probe every interval, or sooner when poked, until `stop` is set."""
        while not stop.is_set():
            wait = max(0.0, self._last_run + self.interval_seconds - time.monotonic())
            poked = asyncio.ensure_future(self._poked.wait())
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({poked, stopped}, timeout=wait, return_when="FIRST_COMPLETED")
            finally:
                poked.cancel()
                stopped.cancel()
            if stop.is_set():
                break
            if self._poked.is_set():
                self._poked.clear()
                await asyncio.sleep(max(0.0, self._last_run + POKE_MIN_SECONDS - time.monotonic()))
            try:
                await self.run_once()
            except Exception as exc:
                log.warning("database writer probe failed: %r", exc)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def status(self) -> dict[str, str]:
        """Each node's last verdict, for /readyz."""
        return {r.name: r.reason for r in (self.reports.get(n) for n in self.nodes) if r}
