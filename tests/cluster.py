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
                redis.Redis(port=port, socket_timeout=1).ping()
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
        return self

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
                info = redis.Redis(port=port, socket_timeout=1).cluster("info")
            except redis.RedisError:
                return False
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
        return True

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.base_port, decode_responses=True)

    def primary_port_of(self, key: str) -> int:
        c = self.client()
        try:
            node = c.get_node_from_key(key)
            return int(node.port)
        finally:
            c.close()

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
            r = redis.Redis(port=port, socket_timeout=2)
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
