"""A local Redis Cluster for the tests: 3 primaries and 3 replicas, plain
`redis-server` processes on loopback ports (no container), created with the exact
`redis-cli --cluster create` line the README gives.

    python -m tests.cluster up 18510     # start one (prints its URL), for a manual run
    python -m tests.cluster down 18510   # stop it and remove its files

The test fixtures (tests/conftest.py `redis_cluster`, GATE_TEST_REDIS_CLUSTER=1) start
one per session and stop it at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

NODES = 6
REPLICAS = 1
# How long a primary may be silent before its replica takes over; low for the
# failover tests, not so low that a busy 2-core machine triggers false failovers.
NODE_TIMEOUT_MS = 2000
START_TIMEOUT_SECONDS = 60.0


_CLUSTER_CLIENTS: list[bool] = []


def mark_cluster_clients_used() -> None:
    """This process used redis-py's asyncio cluster client (tests/conftest.py)."""
    if not _CLUSTER_CLIENTS:
        _CLUSTER_CLIENTS.append(True)


def cluster_clients_used() -> bool:
    return bool(_CLUSTER_CLIENTS)


def cluster_supported() -> bool:
    """redis-server and redis-cli are installed, and the server is 7.x+ (cluster
    mode with CLUSTER SHARDS)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        return False
    out = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout
    try:
        version = out.split("v=", 1)[1].split()[0]
        return int(version.split(".")[0]) >= 7
    except (IndexError, ValueError):
        return False


def create_command(ports: list[int]) -> list[str]:
    return [
        "redis-cli",
        "--cluster",
        "create",
        *(f"127.0.0.1:{p}" for p in ports),
        "--cluster-replicas",
        str(REPLICAS),
        "--cluster-yes",
    ]


@dataclass
class LocalCluster:
    base_port: int
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gate-cluster-")))
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def ports(self) -> list[int]:
        return [self.base_port + i for i in range(NODES)]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.base_port}/0"

    def start_node(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        log = open(node_dir / "redis.log", "ab")
        self.procs[port] = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--dir",
                str(node_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                # A replica's first full sync starts at once (the default waits 5 s
                # for more replicas), and a replica may always stand for election:
                # a test may kill a primary seconds after the cluster was made.
                "--repl-diskless-sync-delay",
                "0",
                "--cluster-replica-validity-factor",
                "0",
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=port, socket_timeout=1) as probe:
                    probe.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def start(self) -> LocalCluster:
        for port in self.ports:
            self.start_node(port)
        subprocess.run(create_command(self.ports), check=True, capture_output=True, timeout=60)
        self.wait_ok()
        self.wait_replicas_synced()
        return self

    def wait_replicas_synced(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Every replica has finished its first sync with its primary (a replica that
        never synced cannot take over when its primary is killed)."""
        deadline = time.monotonic() + timeout
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            while True:
                with redis.Redis(port=port, socket_timeout=1) as node:
                    info = node.info("replication")
                if info.get("role") != "slave" or info.get("master_link_status") == "up":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {port} not synced in time")
                time.sleep(0.1)

    def wait_ok(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Every live node reports cluster_state:ok and all 16384 slots served."""
        deadline = time.monotonic() + timeout
        while True:
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("local Redis Cluster not healthy in time")
            time.sleep(0.2)

    def healthy(self) -> bool:
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            try:
                with redis.Redis(port=port, socket_timeout=1) as node:
                    info = node.cluster("info")
            except redis.RedisError:
                return False
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
        return True

    def client(self) -> redis.RedisCluster:
        port = next(p for p, proc in self.procs.items() if proc.poll() is None)
        return redis.RedisCluster(host="127.0.0.1", port=port, decode_responses=True)

    def primary_port_of(self, key: str) -> int:
        c = self.client()
        try:
            node = c.get_node_from_key(key)
            return int(node.port)
        finally:
            c.close()

    def _live(self) -> redis.Redis:
        port = next(p for p, proc in self.procs.items() if proc.poll() is None)
        return redis.Redis(port=port, decode_responses=True, socket_timeout=5)

    def primaries(self) -> dict[int, tuple[str, list[tuple[int, int]]]]:
        """port -> (node id, slot ranges) of every live primary (CLUSTER NODES)."""
        out: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        with self._live() as node:
            text = str(node.execute_command("CLUSTER", "NODES"))
        for line in text.splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            ranges = []
            for r in parts[8:]:
                if r.startswith("["):
                    continue  # a slot being imported / migrated
                lo, _, hi = r.partition("-")
                ranges.append((int(lo), int(hi or lo)))
            out[port] = (parts[0], ranges)
        return out

    def replicated_primaries(self) -> set[int]:
        """Ports of the live primaries that have a live replica (one that a SIGKILL of
        the primary would promote)."""
        with self._live() as node:
            text = str(node.execute_command("CLUSTER", "NODES"))
        followed = {
            parts[3]
            for parts in (line.split() for line in text.splitlines())
            if "slave" in parts[2] and "fail" not in parts[2] and parts[7] == "connected"
        }
        return {port for port, (node_id, _) in self.primaries().items() if node_id in followed}

    def migrate_slot(self, slot: int, dst_port: int, batch: int = 10, pause: float = 0.05) -> int:
        """Move one slot to the primary on `dst_port` as `redis-cli --cluster reshard`
        does (IMPORTING / MIGRATING, MIGRATE a few keys at a time, SETSLOT NODE);
        returns how many keys moved."""
        nodes = self.primaries()
        src_port = next(p for p, (_, rs) in nodes.items() if any(a <= slot <= b for a, b in rs))
        src_id, dst_id = nodes[src_port][0], nodes[dst_port][0]
        moved = 0
        with (
            redis.Redis(port=src_port, decode_responses=True, socket_timeout=10) as src,
            redis.Redis(port=dst_port, decode_responses=True, socket_timeout=10) as dst,
        ):
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause)
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for port in nodes:
            if port not in (src_port, dst_port):
                with redis.Redis(port=port) as other:
                    other.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved

    def wait_promoted(self, dead_port: int, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """A replica of the (killed) primary on `dead_port` serves its slots, and the
        cluster is healthy again."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                masters = self.primaries()
                served = sum(
                    b - a + 1 for p, (_, rs) in masters.items() if p != dead_port for a, b in rs
                )
                if served == 16384 and self.healthy():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica of {dead_port} promoted in time")
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        proc = self.procs[port]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def flush(self) -> None:
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            with redis.Redis(port=port, socket_timeout=2) as r:
                if r.info("replication").get("role") == "master":
                    r.flushall()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.directory, ignore_errors=True)


def flush_all_primaries(url: str, mode: str) -> None:
    """FLUSHDB on the suite's server, or on every primary of its cluster."""
    if mode == "cluster":
        cluster = redis.RedisCluster.from_url(url)
        try:
            cluster.flushdb(target_nodes=redis.RedisCluster.PRIMARIES)
        finally:
            cluster.close()
        return
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _pidfile(base_port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"gate-cluster-{base_port}.json"


def main(argv: list[str]) -> int:
    import json

    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.cluster up|down BASE_PORT", file=sys.stderr)
        return 2
    base = int(argv[1])
    state = _pidfile(base)
    if argv[0] == "up":
        cluster = LocalCluster(base).start()
        state.write_text(
            json.dumps(
                {"dir": str(cluster.directory), "pids": [p.pid for p in cluster.procs.values()]}
            )
        )
        print(cluster.url)
        return 0
    data = json.loads(state.read_text())
    for pid in data["pids"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(data["dir"], ignore_errors=True)
    state.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
