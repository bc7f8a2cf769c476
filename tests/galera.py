"""A local MariaDB Galera cluster for the tests: three `mariadbd` processes on loopback
(Debian's mariadb-server + galera-4, rsync state transfer), no container.

    python -m tests.galera up 18610      # start one (prints its URL), for a manual run
    python -m tests.galera down 18610    # stop it and remove its files

    base port B, node i (0, 1, 2) at B + 10*i + ...
        +0 mysql   +1 gcomm (group communication)   +2 SST (rsync)   +3 IST

    start():  mariadb-install-db once  ->  node 0 --wsrep-new-cluster
              ->  nodes 1, 2 join (empty datadir: full state transfer from a donor)
              ->  every node Synced (wsrep_local_state = 4), cluster size 3

Each node has its own directory (datadir, my.cnf, error.log) under one temporary
directory, and runs as the `mysql` user when the tests run as root: a loopback
rsync state transfer fails between root-owned nodes (the rsync daemon the joiner
starts drops to `nobody` and cannot write the datadir). Root connects over loopback
without a password, as on the dev server.

Faults for the tests: kill(i) (SIGKILL, for good), restart(i) (the same datadir
rejoins by IST or SST), isolate(i) / heal(i) (gmcast.isolate: the node drops out of
the group and turns non-Primary, not Synced; then comes back). The test fixtures
(tests/conftest.py `galera`, GATE_TEST_GALERA=1) start one per session.
LocalGalera(port, nodes=1, wsrep=False) starts one plain server the same way (the
single-server baseline of loadtest/bench_galera.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pymysql

NODES = 3
ER_WRONG_ARGUMENTS = 1210
PROVIDER = "/usr/lib/galera/libgalera_smm.so"
SYNCED = 4
START_TIMEOUT_SECONDS = 90.0
# A node silent this long is suspected and evicted from the group (Galera's default
# is 5 s): low enough that a killed writer's survivors commit again well within the
# gate's 10 s failover, not so low that a busy 2-core machine evicts a live node.
SUSPECT_TIMEOUT = "PT3S"
INACTIVE_TIMEOUT = "PT6S"


def galera_supported() -> bool:
    """mariadbd, mariadb-install-db, the Galera provider and rsync are installed."""
    return (
        Path(PROVIDER).exists()
        and shutil.which("rsync") is not None
        and shutil.which("mariadb-install-db") is not None
        and (shutil.which("mariadbd") is not None or Path("/usr/sbin/mariadbd").exists())
    )


def _mariadbd() -> str:
    return shutil.which("mariadbd") or "/usr/sbin/mariadbd"


def _run_as() -> str:
    """The account the nodes run as: `mysql` for root (see the module docstring),
    otherwise whoever runs the tests."""
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("mysql")
            return "mysql"
        except KeyError:
            pass
    return pwd.getpwuid(os.geteuid()).pw_name


@dataclass
class NodeStatus:
    """What a node says about itself (SHOW STATUS LIKE 'wsrep_%', @@read_only)."""

    local_state: int
    cluster_size: int
    cluster_status: str
    ready: bool
    read_only: bool

    @property
    def synced(self) -> bool:
        return self.local_state == SYNCED and self.cluster_status == "Primary" and self.ready


@dataclass
class LocalGalera:
    base_port: int
    nodes: int = NODES
    database: str = "gate_test"
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gate-galera-")))
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    user: str = field(default_factory=_run_as)
    # False: plain servers started the same way, no Galera (one, for the benchmark's
    # single-server baseline), with the single-server durability Gate asks for.
    wsrep: bool = True
    # innodb_flush_log_at_trx_commit; None: 2 on Galera (a commit is on every node;
    # each node's redo log is flushed once a second, Galera's usual setting), 1 on a
    # single server (its redo log is the only copy).
    flush_log_at_trx_commit: int | None = None
    start_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.flush_log_at_trx_commit is None:
            self.flush_log_at_trx_commit = 2 if self.wsrep else 1
        if not self.wsrep and self.nodes != 1:
            raise ValueError("without wsrep, LocalGalera starts one server")

    # -- addresses ---------------------------------------------------------------

    def port(self, i: int) -> int:
        """The MySQL port of node i (0-based, in URL order)."""
        return self.base_port + 10 * i

    def _gcomm_port(self, i: int) -> int:
        return self.base_port + 10 * i + 1

    def _sst_port(self, i: int) -> int:
        return self.base_port + 10 * i + 2

    def _ist_port(self, i: int) -> int:
        return self.base_port + 10 * i + 3

    @property
    def hosts(self) -> list[str]:
        """host:port of every node, in URL order."""
        return [f"127.0.0.1:{self.port(i)}" for i in range(self.nodes)]

    @property
    def url(self) -> str:
        """mysql://root@n0,n1,n2/database: every node, in order (GATE_MYSQL_URL)."""
        return self.url_for(self.base_port, self.database, self.nodes)

    @staticmethod
    def url_for(base_port: int, database: str, nodes: int = NODES) -> str:
        """The URL of the cluster a LocalGalera at `base_port` starts (known before
        it starts: the suite's environment is built first)."""
        hosts = ",".join(f"127.0.0.1:{base_port + 10 * i}" for i in range(nodes))
        return f"mysql://root@{hosts}/{database}"

    def node_url(self, i: int) -> str:
        return f"mysql://root@{self.hosts[i]}/{self.database}"

    @property
    def node_urls(self) -> list[str]:
        return [self.node_url(i) for i in range(self.nodes)]

    def node_dir(self, i: int) -> Path:
        return self.directory / f"node{i}"

    # -- processes ---------------------------------------------------------------

    def _config(self, i: int) -> str:
        d = self.node_dir(i)
        common = (
            "[mysqld]",
            f"user={self.user}",
            f"datadir={d / 'data'}",
            f"socket={d / 'mysqld.sock'}",
            f"pid-file={d / 'mysqld.pid'}",
            f"log-error={d / 'error.log'}",
            f"port={self.port(i)}",
            "bind-address=127.0.0.1",
            "innodb_buffer_pool_size=64M",
            "innodb_log_file_size=48M",
            "max_connections=400",
            "binlog_format=ROW",
            "innodb_autoinc_lock_mode=2",
            "default_storage_engine=InnoDB",
            f"innodb_flush_log_at_trx_commit={self.flush_log_at_trx_commit}",
        )
        if not self.wsrep:
            return "\n".join((*common, ""))
        return "\n".join((*common, *self._wsrep_config(i), ""))

    def _wsrep_config(self, i: int) -> tuple[str, ...]:
        peers = ",".join(f"127.0.0.1:{self._gcomm_port(j)}" for j in range(self.nodes))
        provider_options = ";".join(
            (
                f"gmcast.listen_addr=tcp://127.0.0.1:{self._gcomm_port(i)}",
                f"ist.recv_addr=127.0.0.1:{self._ist_port(i)}",
                "gcache.size=64M",
                f"evs.suspect_timeout={SUSPECT_TIMEOUT}",
                f"evs.inactive_timeout={INACTIVE_TIMEOUT}",
            )
        )
        return (
            "wsrep_on=ON",
            f"wsrep_provider={PROVIDER}",
            f"wsrep_cluster_name=gate-galera-{self.base_port}",
            f"wsrep_cluster_address=gcomm://{peers}",
            f"wsrep_node_name=node{i}",
            f"wsrep_node_address=127.0.0.1:{self._gcomm_port(i)}",
            f"wsrep_node_incoming_address=127.0.0.1:{self.port(i)}",
            "wsrep_sst_method=rsync",
            f"wsrep_sst_receive_address=127.0.0.1:{self._sst_port(i)}",
            f'wsrep_provider_options="{provider_options}"',
            "wsrep_slave_threads=2",
            # MariaDB 11.8 as Debian 13 builds it loads the wsrep_provider plugin, which
            # makes wsrep_provider_options read-only (error 1210): isolate() sets
            # gmcast.isolate at run time. "loose-": older servers ignore the option.
            "loose-plugin-wsrep-provider=OFF",
        )

    def _chown(self, path: Path) -> None:
        subprocess.run(["chown", "-R", f"{self.user}:", str(path)], check=True)

    def _install_template(self) -> Path:
        """One system-tables datadir, copied into node 0 (the joiners get theirs by
        state transfer)."""
        template = self.directory / "template"
        template.mkdir()
        self._chown(template)
        log = self.directory / "install.log"
        with open(log, "wb") as out:
            done = subprocess.run(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={template}",
                    f"--user={self.user}",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=120,
                check=False,
            )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {log.read_text()[-2000:]}")
        return template

    def _prepare(self, i: int, template: Path | None) -> None:
        d = self.node_dir(i)
        d.mkdir(parents=True, exist_ok=True)
        data = d / "data"
        if template is not None:
            shutil.copytree(template, data, symlinks=True)
        else:
            data.mkdir(exist_ok=True)
        (d / "my.cnf").write_text(self._config(i))
        self._chown(d)

    def _spawn(self, i: int, bootstrap: bool = False) -> None:
        d = self.node_dir(i)
        log = open(d / "stdout.log", "ab")
        args = [_mariadbd(), f"--defaults-file={d / 'my.cnf'}"]
        if bootstrap:
            args.append("--wsrep-new-cluster")
        self.procs[i] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def start(self) -> LocalGalera:
        started = time.monotonic()
        # Every directory on the way to a datadir must be traversable by the nodes'
        # account (mkdtemp makes it 0700).
        self.directory.chmod(0o755)
        template = self._install_template()
        for i in range(self.nodes):
            self._prepare(i, template if i == 0 else None)
        shutil.rmtree(template, ignore_errors=True)
        self._spawn(0, bootstrap=self.wsrep)
        self.wait_synced(0)
        for i in range(1, self.nodes):
            self._spawn(i)
        for i in range(self.nodes):
            self.wait_synced(i, cluster_size=self.nodes)
        self.start_seconds = time.monotonic() - started
        return self

    def alive(self, i: int) -> bool:
        proc = self.procs.get(i)
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL node i (its process group and any helper it started): it dies
        mid-transaction, nothing runs on the way out."""
        proc = self.procs.get(i)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        self._kill_strays(self.node_dir(i))

    def pause(self, i: int) -> None:
        """SIGSTOP node i: it keeps its sockets (connections are accepted by the
        kernel) and answers nothing, as a stalled host does. resume(i) before the
        cluster's suspect timeout, or the others go on without it."""
        os.kill(self.procs[i].pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGCONT)

    def _kill_strays(self, under: Path) -> None:
        """Processes a node started that left its process group (a state-transfer
        script's rsync daemon): found by the node's own directory on their command
        line, which no other process names."""
        marker = str(under)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline and int(entry.name) != os.getpid():
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def restart(self, i: int, wait: bool = True) -> None:
        """Start a killed node i again on its datadir: it rejoins the cluster
        (incremental state transfer when the donor's gcache still holds what it
        missed, else a full rsync copy) and is Synced when this returns (wait)."""
        self.kill(i)
        self._spawn(i)
        if wait:
            self.wait_synced(i, cluster_size=self.live_count())

    def live_count(self) -> int:
        return sum(1 for i in range(self.nodes) if self.alive(i))

    def _set_isolate(self, i: int, value: int) -> None:
        with self.connect(i) as conn, conn.cursor() as cur:
            cur.execute(f"SET GLOBAL wsrep_provider_options = 'gmcast.isolate={value}'")

    def can_isolate(self) -> bool:
        """Whether the nodes take gmcast.isolate at run time: not where the
        wsrep_provider plugin is loaded all the same (error 1210; the node's
        configuration turns it off); the tests that cut a node off skip there."""
        try:
            self._set_isolate(0, 0)
        except pymysql.err.MySQLError as exc:
            if exc.args and exc.args[0] == ER_WRONG_ARGUMENTS:
                return False
            raise
        return True

    def isolate(self, i: int) -> None:
        """Cut node i off the group (it stays up and answers): it turns non-Primary
        and stops being Synced; the others go on as a cluster of the rest."""
        self._set_isolate(i, 1)

    def heal(self, i: int, wait: bool = True) -> None:
        """Let an isolated node i back into the group; it is Synced again when this
        returns (wait)."""
        self._set_isolate(i, 0)
        if wait:
            self.wait_synced(i, cluster_size=self.live_count())

    # -- state ---------------------------------------------------------------------

    def connect(self, i: int, timeout_seconds: float = 5.0) -> pymysql.Connection:  # type: ignore[type-arg]
        return pymysql.connect(
            host="127.0.0.1",
            port=self.port(i),
            user="root",
            connect_timeout=timeout_seconds,
            read_timeout=timeout_seconds,
            write_timeout=timeout_seconds,
            autocommit=True,
        )

    def status(self, i: int) -> NodeStatus:
        """Node i's wsrep state (raises pymysql's OperationalError when it does not
        answer)."""
        with self.connect(i, 2.0) as conn, conn.cursor() as cur:
            cur.execute(
                "SHOW GLOBAL STATUS WHERE Variable_name IN ('wsrep_local_state',"
                " 'wsrep_cluster_size', 'wsrep_cluster_status', 'wsrep_ready')"
            )
            values = {str(k): str(v) for k, v in cur.fetchall()}
            cur.execute("SELECT @@read_only")
            row = cur.fetchone()
        return NodeStatus(
            local_state=int(values.get("wsrep_local_state", "0") or 0),
            cluster_size=int(values.get("wsrep_cluster_size", "0") or 0),
            cluster_status=values.get("wsrep_cluster_status", ""),
            ready=values.get("wsrep_ready", "OFF") == "ON",
            read_only=bool(row and int(row[0])),
        )

    def wait_synced(
        self, i: int, cluster_size: int | None = None, timeout: float = START_TIMEOUT_SECONDS
    ) -> NodeStatus:
        """Node i is Synced in a Primary component (of `cluster_size` nodes)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            if not self.alive(i):
                raise RuntimeError(f"galera node{i} exited: {self.log_tail(i)}")
            try:
                state = self.status(i)
                last = state
                if not self.wsrep:
                    return state
                if state.synced and (cluster_size is None or state.cluster_size == cluster_size):
                    return state
            except pymysql.MySQLError as exc:
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"galera node{i} not synced ({last}): {self.log_tail(i)}")
            time.sleep(0.2)

    def wait_not_synced(self, i: int, timeout: float = 30.0) -> NodeStatus:
        deadline = time.monotonic() + timeout
        while True:
            state = self.status(i)
            if not state.synced:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"galera node{i} still synced: {state}")
            time.sleep(0.1)

    def wait_size(self, i: int, size: int, timeout: float = 30.0) -> None:
        """Node i is Synced in a Primary component of exactly `size` nodes (after a
        kill: the dead node was evicted)."""
        self.wait_synced(i, cluster_size=size, timeout=timeout)

    def log_tail(self, i: int, chars: int = 3000) -> str:
        log = self.node_dir(i) / "error.log"
        try:
            return log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no error.log)"

    def stop(self) -> None:
        """Kill every node and remove every file (safe to call twice, and after a
        start that failed half-way)."""
        for i in list(self.procs):
            self.kill(i)
        if self.directory.exists():
            self._kill_strays(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)


def _pidfile(base_port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"gate-galera-{base_port}.json"


def main(argv: list[str]) -> int:
    import json

    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.galera up|down BASE_PORT", file=sys.stderr)
        return 2
    base = int(argv[1])
    state = _pidfile(base)
    if argv[0] == "up":
        galera = LocalGalera(base)
        try:
            galera.start()
        except BaseException:
            galera.stop()
            raise
        pids = [p.pid for p in galera.procs.values()]
        state.write_text(json.dumps({"dir": str(galera.directory), "pids": pids}))
        print(galera.url)
        return 0
    data = json.loads(state.read_text())
    for pid in data["pids"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    LocalGalera(base, directory=Path(data["dir"])).stop()
    state.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
