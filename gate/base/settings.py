"""Settings: read once from the environment, typed, with units last in every name.

Secrets are wrapped in `Secret` so that no repr, log line or traceback prints them.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from secrets import token_urlsafe
from types import MappingProxyType
from urllib.parse import unquote, urlsplit

from gate.base.limits import SCOPES, LimitError, LimitSpec, Network, parse_limit, parse_networks

# The published values moved to gate/base/published.py; the areas and the tests name
# them through this module too (`X as X`: re-exported).
from gate.base.published import DEV_ADMIN_TOKEN as DEV_ADMIN_TOKEN
from gate.base.published import DEV_ADMISSION_SECRET as DEV_ADMISSION_SECRET
from gate.base.published import DEV_JWT_SECRET as DEV_JWT_SECRET
from gate.base.published import DEV_ONLY as DEV_ONLY
from gate.base.published import DEV_PASSWORDS as DEV_PASSWORDS
from gate.base.published import DEV_SANDBOX_API_KEY as DEV_SANDBOX_API_KEY
from gate.base.published import DEV_WEBHOOK_SECRET as DEV_WEBHOOK_SECRET
from gate.base.published import published_reason
from gate.base.published import webhook_key as webhook_key
from gate.base.redis_url import RedisConfig, RedisUrlError, host_port, redis_config


def refuse_dev_value(name: str, value: str | None, dev_values: frozenset[str], dev: bool) -> None:
    """Outside dev, a value published for development (compared whitespace-stripped)
    is refused: SettingsError naming the variable, never the value."""
    if not dev and value is not None and value.strip() in dev_values:
        raise SettingsError(f"{name} is {DEV_ONLY}")


def refuse_published(name: str, value: str | None, dev: bool) -> None:
    """Outside dev, a secret the repository publishes (a development value, an
    example's placeholder: gate/base/published.py) is refused, each entry of a
    whitespace-separated list alike: SettingsError naming `name`, never the value."""
    if dev or not value:
        return
    for entry in value.split():
        reason = published_reason(entry)
        if reason is not None:
            raise SettingsError(f"{name} is {reason}")


# A per-deal buyer limit is on by default (no human clicks 20 times a second); the
# others depend on the deployment (shared NAT addresses, device ids) and are opt-in.
DEFAULT_LIMITS = {
    "deal": "off",
    "user": "20/s burst 40",
    "ip": "off",
    "device": "off",
    "global": "off",
}


class SettingsError(ValueError):
    """A setting is missing or malformed; start-up must stop with this message."""


class Secret:
    """A string that never shows itself in repr/str; `.reveal()` is explicit."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


# Every variable that holds a secret. Each may instead be given as a file, NAME_FILE
# (how Docker and Kubernetes mount secrets), read by `with_secret_files`, the one
# place secrets come in: whatever reads NAME from the settings' environment gets the
# file's content. The database and Redis URLs are here whole (they carry the
# password): a URL file, not a password variable besides the URL.
SECRET_NAMES = (
    "GATE_JWT_SECRET",
    "GATE_ADMIN_TOKEN",
    "GATE_WEBHOOK_SECRET",
    "GATE_ADMISSION_SECRET",
    "GATE_CONSOLE_SECRET",
    "GATE_MYSQL_URL",
    "GATE_MYSQL_APP_PASSWORD",
    "GATE_REDIS_URL",
    "GATE_PAYMENT_API_KEY",
    "GATE_STRIPE_API_KEY",
    "GATE_STRIPE_WEBHOOK_SECRET",
    "GATE_WECHATPAY_APIV3_KEY",
    "GATE_SANDBOX_API_KEY",
    "GATE_SANDBOX_WEBHOOK_SECRET",
    "GATE_WEBHOOK_ENCRYPTION_KEY",
)
FILE_SUFFIX = "_FILE"
# A secret is short; a bigger file is a wrong path (and is not read whole).
SECRET_FILE_MAX_BYTES = 65_536


def read_secret_file(variable: str, path: str) -> str:
    """The content of the secret file `variable` names, one trailing newline (LF or
    CRLF) stripped; SettingsError naming the variable and the path, never the content."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            # A FIFO or a device would block or never end.
            raise SettingsError(f"{variable}: {path!r} is not a regular file")
        with open(path, "rb") as f:
            data = f.read(SECRET_FILE_MAX_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise SettingsError(f"{variable}: cannot read {path!r} ({reason})") from None
    if len(data) > SECRET_FILE_MAX_BYTES:
        raise SettingsError(f"{variable}: {path!r} is over {SECRET_FILE_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SettingsError(f"{variable}: {path!r} is not UTF-8 text") from None
    if text.endswith("\n"):
        text = text[:-1].removesuffix("\r")
    return text


def with_secret_files(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with every secret given as NAME_FILE read into NAME. Setting both (each
    non-empty) is a SettingsError naming the two: which one wins would be a guess."""
    resolved = dict(env)
    for name in SECRET_NAMES:
        variable = name + FILE_SUFFIX
        path = env.get(variable, "").strip()
        if not path:
            continue
        if env.get(name, "").strip():
            raise SettingsError(f"{name} and {variable} are both set: set one of them")
        resolved[name] = read_secret_file(variable, path)
    return resolved


# One node of GATE_MYSQL_URL: (host, port).
MysqlNode = tuple[str, int]
_MYSQL_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
MYSQL_NODES_MAX = 16


def node_name(node: MysqlNode) -> str:
    """ "host:port" ("[v6]:port"): how logs, /readyz and metrics name a node."""
    host, port = node
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _mysql_node(item: str) -> MysqlNode:
    """One "host[:port]" of GATE_MYSQL_URL's host list (port 3306 when left out)."""
    host, port = item, "3306"
    if item.startswith("["):
        end = item.find("]")
        host, rest = item[: end + 1], item[end + 1 :]
        if rest:
            port = rest[1:] if rest.startswith(":") else "?"
    elif ":" in item:
        host, port = item.rsplit(":", 1)
    if not _MYSQL_HOST.fullmatch(host or "?"):
        raise SettingsError(f"GATE_MYSQL_URL has a host that is not a name or address: {host!r}")
    if not (port.isdigit() and 1 <= int(port) <= 65_535):
        raise SettingsError("GATE_MYSQL_URL has a port that is not 1-65535")
    return host.strip("[]").lower(), int(port)


# scheme :// netloc (user info and the host list, up to the path, query or fragment) rest
_URL_HOSTS_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)(.*)$", re.DOTALL)


@dataclass(frozen=True)
class MysqlTarget:
    """Where the database is. `host`/`port` name the first node; `nodes` every node of
    a synchronous cluster (several hosts in the URL, gate/store/dbwriter.py picks the one
    that takes writes), or () for a single server."""

    host: str
    port: int
    user: str
    password: Secret
    database: str
    unix_socket: str | None = None
    nodes: tuple[MysqlNode, ...] = ()

    @property
    def node_list(self) -> tuple[MysqlNode, ...]:
        """Every node, in the URL's order (a single server: its one node)."""
        return self.nodes or ((self.host, self.port),)

    @property
    def clustered(self) -> bool:
        return len(self.nodes) > 1

    def on(self, node: MysqlNode) -> MysqlTarget:
        """The same database, user and password on one node only."""
        return replace(self, host=node[0], port=node[1], nodes=())

    @classmethod
    def parse(cls, url: str) -> MysqlTarget:
        # The host list is taken out before urlsplit sees the URL: newer Pythons (3.13,
        # Debian 13's) refuse a bracketed IPv6 host that is not the netloc's first
        # ("Invalid IPv6 URL" for h1,[fd00::4]:3311); the list is split below.
        listed = _URL_HOSTS_RE.match(url)
        netloc = listed[2] if listed else ""
        parts = urlsplit(f"{listed[1]}://host{listed[3]}" if listed else url)
        if parts.scheme not in ("mysql", "mariadb"):
            raise SettingsError(
                f"GATE_MYSQL_URL must start with mysql://, got scheme {parts.scheme!r}"
            )
        database = parts.path.lstrip("/") or "gate"
        if not database.replace("_", "").isalnum():
            raise SettingsError("GATE_MYSQL_URL database name must be [A-Za-z0-9_]+")
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        # urlsplit's hostname/port know one host only: the list is split here.
        userinfo, _, hosts = (netloc if listed else parts.netloc).rpartition("@")
        username, _, password = userinfo.partition(":")
        items = hosts.split(",") if hosts else []
        if len(items) > MYSQL_NODES_MAX:
            raise SettingsError(f"GATE_MYSQL_URL names more than {MYSQL_NODES_MAX} hosts")
        nodes = tuple(_mysql_node(item) for item in items) or (("127.0.0.1", 3306),)
        if len(set(nodes)) != len(nodes):
            raise SettingsError("GATE_MYSQL_URL names a host:port twice")
        unix_socket = query.get("unix_socket")
        if unix_socket and len(nodes) > 1:
            raise SettingsError("GATE_MYSQL_URL: unix_socket goes with one host only")
        return cls(
            host=nodes[0][0],
            port=nodes[0][1],
            user=unquote(username or "root"),
            password=Secret(unquote(password)),
            database=database,
            unix_socket=unix_socket,
            nodes=nodes if len(nodes) > 1 else (),
        )


def env_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise SettingsError(f"{name} must be within {lo}..{hi}, got {value}")
    return value


def env_float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not lo <= value <= hi:
        raise SettingsError(f"{name} must be within {lo}..{hi}, got {value}")
    return value


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be a boolean (1/0, true/false, on/off), got {raw!r}")


@dataclass(frozen=True)
class JwtIdp:
    """Buyer tokens signed by the shop's identity provider (gate/web/jwks.py): its
    key set from a file or a URL (one of them), and the claims its tokens must carry."""

    jwks_file: str | None
    jwks_url: str | None
    refresh_seconds: float
    issuer: str | None
    audience: str | None


def _jwt_idp(env: Mapping[str, str], dev: bool) -> JwtIdp | None:
    """GATE_JWT_JWKS_FILE / _URL (https outside dev), _REFRESH_SECONDS, GATE_JWT_ISSUER,
    GATE_JWT_AUDIENCE; None when no key set is configured."""
    file = env.get("GATE_JWT_JWKS_FILE", "").strip() or None
    url = env.get("GATE_JWT_JWKS_URL", "").strip() or None
    issuer = env.get("GATE_JWT_ISSUER", "").strip() or None
    audience = env.get("GATE_JWT_AUDIENCE", "").strip() or None
    if file is None and url is None:
        if issuer or audience:
            raise SettingsError(
                "GATE_JWT_ISSUER and GATE_JWT_AUDIENCE apply to the identity provider's"
                " tokens: set GATE_JWT_JWKS_FILE or GATE_JWT_JWKS_URL too"
            )
        return None
    if file and url:
        raise SettingsError("set GATE_JWT_JWKS_FILE or GATE_JWT_JWKS_URL, not both")
    if url is not None:
        parts = urlsplit(url)
        allowed = ("https", "http") if dev else ("https",)
        if parts.scheme not in allowed or not parts.hostname:
            raise SettingsError(
                "GATE_JWT_JWKS_URL must be an https:// URL (http:// only with GATE_ENV=dev)"
            )
    if not dev and (issuer is None or audience is None):
        # Without both, any token the provider signs, for any of its applications
        # (or any tenant of a shared one), would buy here.
        raise SettingsError(
            "GATE_JWT_JWKS_FILE / GATE_JWT_JWKS_URL need GATE_JWT_ISSUER and"
            " GATE_JWT_AUDIENCE outside GATE_ENV=dev: set both, to the issuer and the"
            " audience of the tokens meant for this gate"
        )
    refresh = env_float(env, "GATE_JWT_JWKS_REFRESH_SECONDS", 300.0, 1.0, 86_400.0)
    return JwtIdp(file, url, refresh, issuer, audience)


def _given(env: Mapping[str, str], name: str) -> bool:
    """The secret is set, as itself or as NAME_FILE."""
    return bool(env.get(name, "").strip() or env.get(f"{name}_FILE", "").strip())


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Settings:
    env: str
    # May carry a password: kept out of the repr.
    redis_url: str = field(repr=False)
    mysql: MysqlTarget
    jwt_secret: Secret
    admin_token: Secret
    webhook_secrets: tuple[Secret, ...]
    admission_secret: Secret
    dev_secrets_used: tuple[str, ...] = ()

    # Database pool and transaction bounds.
    db_pool_max: int = 32
    db_connect_timeout_seconds: float = 3.0
    db_lock_wait_seconds: int = 5
    db_retry_max: int = 3
    reservation_db_timeout_seconds: float = 10.0
    # Several hosts in GATE_MYSQL_URL (gate/store/dbwriter.py): how often each node is
    # probed, how long a probe may take, and how long a node that was unusable must
    # have been usable again before it takes the writes back.
    db_probe_interval_seconds: float = 1.0
    db_probe_timeout_seconds: float = 1.0
    db_writer_hold_down_seconds: float = 30.0

    # Redis bounds and what happens when Redis is in trouble.
    redis_pool_max: int = 64
    # "auto" asks the node (INFO cluster) at start-up; "standalone" or "cluster".
    redis_mode: str = "auto"
    # Redis Cluster: more nodes to start from than GATE_REDIS_URL's (host, port).
    redis_cluster_nodes: tuple[tuple[str, int], ...] = ()
    redis_timeout_seconds: float = 0.5
    redis_pipeline_max: int = 512
    redis_flush_every: int = 0
    # Python's cyclic collector in a serving process (gate/api/app.py tune_gc): 0 leaves it
    # as Python sets it; otherwise start-up's objects are frozen and a young
    # collection waits for this many net allocations (Python's default: 700).
    gc_gen0_threshold: int = 50_000
    redis_breaker_failures_max: int = 5
    redis_breaker_open_seconds: float = 2.0
    # "reject": reservations answer 503 while Redis is unavailable (the database is
    # never stampeded); "database": they go straight to the database, at most
    # redis_down_db_concurrency_max at a time per process.
    redis_down_policy: str = "reject"
    redis_down_db_concurrency_max: int = 4
    limits_fail_open: bool = False

    # Rate limits (None: off) and who may tell us the client's address.
    limit_deal: LimitSpec | None = None
    limit_user: LimitSpec | None = None
    limit_ip: LimitSpec | None = None
    limit_device: LimitSpec | None = None
    limit_global: LimitSpec | None = None
    trusted_proxies: tuple[Network, ...] = ()
    # The IP limiter counts an IPv6 client as its network of this prefix length.
    limit_ip_v6_prefix: int = 64

    # Bulkheads: reservations may use only part of the pool and wait only briefly
    # for it, so callbacks, cancels and reads always find a connection.
    db_reservation_pool_max: int = 24
    db_reservation_acquire_seconds: float = 1.0
    db_acquire_timeout_seconds: float = 2.0
    reservation_inflight_max: int = 1024
    # Group commit (gate/reserve/groups.py): at most this many reservations of one deal in one
    # transaction (1: no groups), at most this many groups of one deal per process in
    # the database at once.
    reservation_group_max: int = 64
    reservation_groups_in_flight_max: int = 2

    # Reservation protocol bounds.
    idempotency_ttl_seconds: int = 86_400
    inflight_max_seconds: float = 30.0
    janitor_batch_max: int = 500
    janitor_interval_seconds: float = 1.0
    # One process at a time runs each background loop (gate/store/work_lease.py): the
    # lease lasts the loop's interval plus this; 0: every process runs every pass.
    background_lease_seconds: float = 5.0
    janitor_committed_after_seconds: float = 2.0
    # Each gate process's liveness lease (gate/store/process_lease.py), renewed every third of it:
    # a janitor resolves a dead process's in-flight tokens once it has lapsed.
    lease_seconds: float = 3.0
    resync_interval_seconds: float = 1.0
    # A deal whose Redis state has not moved for RESYNC_QUIET_AFTER_SECONDS is
    # resynced this often instead of every pass (gate/inventory/resync.py); 0: every pass.
    resync_quiet_seconds: float = 15.0
    jwt_cache_max: int = 65_536
    # HS256 buyer tokens with GATE_JWT_SECRET; off when only a key set is configured.
    jwt_hs256: bool = True
    jwt_idp: JwtIdp | None = None
    sold_out_cache_seconds: float = 0.1
    body_max_bytes: int = 4096
    # The HTTP guard (gate/web/guard.py): a request's body is due within this many
    # seconds of its start (else 408); at most this many requests in flight per worker
    # (beyond it 503 at once).
    body_timeout_seconds: float = 5.0
    http_concurrency_max: int = 1024

    # `gate serve --workers N` (gate/cli/supervisor.py): a worker whose event loop has not
    # beaten for this long is killed and replaced.
    worker_timeout_seconds: float = 30.0
    # `gate serve` on SIGTERM (gate/cli/draining.py): /readyz answers 503 and the gate
    # keeps serving for the delay, then stops accepting and gives requests in flight
    # up to the grace to finish.
    shutdown_delay_seconds: float = 5.0
    shutdown_grace_seconds: float = 10.0
    # /docs: a browsable reference of /openapi.json (gate/web/docs_page.py).
    docs: bool = False
    # /metrics's own listener (gate/web/metrics_listener.py): GATE_METRICS_ADDR's
    # (host, port), None: off or unset. Unset (`metrics_addr_from_port`), `gate serve`
    # listens on 127.0.0.1 at a port derived from its --port (`metrics_address`).
    metrics_addr: tuple[str, int] | None = None
    metrics_addr_from_port: bool = True

    run_background: bool = True
    auto_migrate: bool = True
    log_level: str = "INFO"
    # The environment as read at start-up, for areas that read their own settings
    # (with env_int & co.). Never printed: it holds the secrets too.
    environ: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_dev(self) -> bool:
        return self.env == "dev"


# GATE_METRICS_ADDR unset: `gate serve --port P` serves /metrics on 127.0.0.1:P+10000
# (P-10000 when that would pass 65535); the default --port 8000 gives 18000. Gates side
# by side on one host differ in --port, so in their metrics port too, and no port of
# the Prometheus exporters' range (9100 node_exporter, ... 9999) is ever the default.
METRICS_PORT_OFFSET = 10_000
PORT_MAX = 65_535
METRICS_HOST_DEFAULT = "127.0.0.1"


def metrics_port_for(port: int) -> int:
    """The default metrics port of a gate serving on `port`."""
    up = port + METRICS_PORT_OFFSET
    return up if up <= PORT_MAX else port - METRICS_PORT_OFFSET


def metrics_address(settings: Settings, port: int) -> tuple[str, int] | None:
    """Where `gate serve --port port` serves /metrics: GATE_METRICS_ADDR, or when it
    is unset 127.0.0.1 at `metrics_port_for(port)`; None: off."""
    if settings.metrics_addr_from_port:
        return METRICS_HOST_DEFAULT, metrics_port_for(port)
    return settings.metrics_addr


def parse_listen_address(name: str, raw: str) -> tuple[str, int] | None:
    """ "host:port" ([v6]:port for IPv6) to listen on, or None for "off"."""
    text = raw.strip()
    if text.lower() == "off":
        return None
    address = host_port(text)
    if address is None:
        raise SettingsError(
            f"{name} must be host:port (e.g. 127.0.0.1:18000, [::1]:18000) or 'off', got {raw!r}"
        )
    return address


# The secrets every gate needs, with the built-in development values used for each
# when GATE_ENV=dev leaves it unset.
REQUIRED_SECRETS = (
    ("GATE_JWT_SECRET", DEV_JWT_SECRET),
    ("GATE_ADMIN_TOKEN", DEV_ADMIN_TOKEN),
    ("GATE_ADMISSION_SECRET", DEV_ADMISSION_SECRET),
    ("GATE_WEBHOOK_SECRET", DEV_WEBHOOK_SECRET),
)
# Outside dev, at least this many characters.
SECRET_MIN_CHARS = {"GATE_JWT_SECRET": 32, "GATE_ADMIN_TOKEN": 32, "GATE_ADMISSION_SECRET": 32}
SECRET_REASONS = {
    "GATE_JWT_SECRET": " for HS256",
    "GATE_ADMIN_TOKEN": " (it guards every admin route and the console)",
}


@dataclass(frozen=True)
class _Secrets:
    jwt: str
    admin: str
    admission: str
    webhook: tuple[Secret, ...]
    dev_used: tuple[str, ...]
    jwt_hs256: bool
    jwt_idp: JwtIdp | None


def _missing_secrets(names: list[str]) -> SettingsError:
    """Every required secret that is not set, named at once: the operator sets them
    in one go (each NAME or NAME_FILE)."""
    listed = ", ".join(names)
    verb = "is" if len(names) == 1 else "are"
    return SettingsError(
        f"{listed} {verb} required: set {'it' if len(names) == 1 else 'each'} (or"
        " NAME_FILE, a file holding it), or GATE_ENV=dev to use the built-in development"
        " values"
    )


def _secrets(env: Mapping[str, str], dev: bool) -> _Secrets:
    """The core's secrets: given, or (GATE_ENV=dev) the built-in development values;
    outside dev none published (gate/base/published.py), none too short."""
    for name in SECRET_NAMES:
        refuse_published(name, env.get(name), dev)
    jwt_idp = _jwt_idp(env, dev)
    # With a key set, HS256 is on only when its secret is given; the secret kept
    # otherwise is random, known to no one (`gate token` mints with it: 401s).
    jwt_hs256 = jwt_idp is None or _given(env, "GATE_JWT_SECRET")
    values = {name: env.get(name, "").strip() for name, _ in REQUIRED_SECRETS}
    if not jwt_hs256:
        values["GATE_JWT_SECRET"] = token_urlsafe(48)
    missing = [name for name, value in values.items() if not value]
    if missing and not dev:
        raise _missing_secrets(missing)
    for name, dev_value in REQUIRED_SECRETS:
        values[name] = values[name] or dev_value
    if not dev:
        for name, chars in SECRET_MIN_CHARS.items():
            if len(values[name]) < chars:
                reason = SECRET_REASONS.get(name, "")
                raise SettingsError(f"{name} must be at least {chars} characters{reason}")
        if values["GATE_ADMISSION_SECRET"] == values["GATE_JWT_SECRET"]:
            raise SettingsError("GATE_ADMISSION_SECRET must differ from GATE_JWT_SECRET")
    webhook = tuple(Secret(s) for s in values["GATE_WEBHOOK_SECRET"].split())
    if not all(s.reveal().startswith("whsec_") for s in webhook):
        raise SettingsError("GATE_WEBHOOK_SECRET entries must look like whsec_<base64>")
    return _Secrets(
        jwt=values["GATE_JWT_SECRET"],
        admin=values["GATE_ADMIN_TOKEN"],
        admission=values["GATE_ADMISSION_SECRET"],
        webhook=webhook,
        dev_used=tuple(name for name in missing if dev),
        jwt_hs256=jwt_hs256,
        jwt_idp=jwt_idp,
    )


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, default).strip().lower() or default
    if value not in allowed:
        raise SettingsError(f"{name} must be {' or '.join(repr(a) for a in allowed)}")
    return value


def _limits(env: Mapping[str, str]) -> tuple[dict[str, LimitSpec | None], tuple[Network, ...]]:
    """GATE_LIMIT_<SCOPE> for every scope and GATE_TRUSTED_PROXIES."""
    try:
        limits = {
            scope: parse_limit(
                f"GATE_LIMIT_{scope.upper()}",
                env.get(f"GATE_LIMIT_{scope.upper()}"),
                DEFAULT_LIMITS[scope],
            )
            for scope in SCOPES
        }
        trusted = parse_networks("GATE_TRUSTED_PROXIES", env.get("GATE_TRUSTED_PROXIES"))
    except LimitError as exc:
        raise SettingsError(str(exc)) from None
    return limits, trusted


def _redis(env: Mapping[str, str], dev: bool) -> RedisConfig:
    try:
        config = redis_config(env)
    except RedisUrlError as exc:
        raise SettingsError(str(exc)) from None
    password = config.target.password
    refuse_published("GATE_REDIS_URL (its password)", password, dev)
    return config


def _check_inflight_max(settings: Settings) -> None:
    """The janitor treats a token older than inflight_max_seconds as orphaned; a live
    request must therefore always finish (or give up) well before that age. A
    statement sent just before the request's deadline may still wait on a lock on
    the server for up to the lock-wait timeout."""
    live_max = (
        settings.reservation_db_timeout_seconds
        + settings.db_lock_wait_seconds
        + 2 * settings.redis_timeout_seconds
    )
    if settings.inflight_max_seconds <= live_max:
        raise SettingsError(
            f"GATE_INFLIGHT_MAX_SECONDS must exceed {live_max:g}: the reservation DB timeout"
            " plus the lock-wait timeout plus twice the Redis timeout"
        )


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read every setting once. Raises SettingsError with a clear message."""
    # Secrets given as files are read here, once: everything below, and every area
    # reading Settings.environ, sees them as if set directly.
    env = with_secret_files(os.environ if environ is None else environ)
    gate_env = env.get("GATE_ENV", "production").strip().lower() or "production"
    dev = gate_env == "dev"
    secrets = _secrets(env, dev)
    limits, trusted = _limits(env)
    down_policy = _choice(env, "GATE_REDIS_DOWN_POLICY", "reject", ("reject", "database"))
    limits_on_error = _choice(env, "GATE_LIMITS_ON_REDIS_ERROR", "closed", ("open", "closed"))
    pool_max = env_int(env, "GATE_DB_POOL_MAX", 32, 2, 1000)
    redis = _redis(env, dev)
    log_level = env.get("GATE_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if log_level not in LOG_LEVELS:
        raise SettingsError(f"GATE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}")
    mysql = MysqlTarget.parse(env.get("GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate"))
    refuse_published("GATE_MYSQL_URL (its password)", mysql.password.reveal(), dev)
    metrics_raw = env.get("GATE_METRICS_ADDR", "")

    settings = Settings(
        env=gate_env,
        redis_url=redis.url,
        mysql=mysql,
        jwt_secret=Secret(secrets.jwt),
        admin_token=Secret(secrets.admin),
        webhook_secrets=secrets.webhook,
        admission_secret=Secret(secrets.admission),
        dev_secrets_used=secrets.dev_used,
        db_pool_max=pool_max,
        db_connect_timeout_seconds=env_float(env, "GATE_DB_CONNECT_TIMEOUT_SECONDS", 3.0, 0.1, 60),
        db_lock_wait_seconds=env_int(env, "GATE_DB_LOCK_WAIT_SECONDS", 5, 1, 120),
        db_retry_max=env_int(env, "GATE_DB_RETRY_MAX", 3, 1, 10),
        reservation_db_timeout_seconds=env_float(
            env, "GATE_RESERVATION_DB_TIMEOUT_SECONDS", 10.0, 0.1, 120
        ),
        db_probe_interval_seconds=env_float(env, "GATE_DB_PROBE_INTERVAL_SECONDS", 1.0, 0.1, 5),
        db_probe_timeout_seconds=env_float(env, "GATE_DB_PROBE_TIMEOUT_SECONDS", 1.0, 0.1, 2),
        db_writer_hold_down_seconds=env_float(
            env, "GATE_DB_WRITER_HOLD_DOWN_SECONDS", 30.0, 0, 3600
        ),
        redis_pool_max=env_int(env, "GATE_REDIS_POOL_MAX", 64, 1, 10_000),
        redis_mode=redis.mode,
        redis_cluster_nodes=redis.cluster_nodes,
        redis_timeout_seconds=env_float(env, "GATE_REDIS_TIMEOUT_SECONDS", 0.5, 0.01, 60),
        redis_breaker_failures_max=env_int(env, "GATE_REDIS_BREAKER_FAILURES", 5, 1, 10_000),
        redis_breaker_open_seconds=env_float(
            env, "GATE_REDIS_BREAKER_OPEN_SECONDS", 2.0, 0.05, 600
        ),
        redis_down_policy=down_policy,
        redis_down_db_concurrency_max=env_int(
            env, "GATE_REDIS_DOWN_DB_CONCURRENCY_MAX", 4, 1, 1000
        ),
        limits_fail_open=limits_on_error == "open",
        limit_deal=limits["deal"],
        limit_user=limits["user"],
        limit_ip=limits["ip"],
        limit_device=limits["device"],
        limit_global=limits["global"],
        trusted_proxies=trusted,
        limit_ip_v6_prefix=env_int(env, "GATE_LIMIT_IP_V6_PREFIX", 64, 32, 128),
        db_reservation_pool_max=env_int(
            env, "GATE_DB_RESERVATION_POOL_MAX", max(1, pool_max * 3 // 4), 1, pool_max
        ),
        db_reservation_acquire_seconds=env_float(
            env, "GATE_DB_RESERVATION_ACQUIRE_SECONDS", 1.0, 0.001, 60
        ),
        db_acquire_timeout_seconds=env_float(env, "GATE_DB_ACQUIRE_TIMEOUT_SECONDS", 2.0, 0.01, 60),
        reservation_inflight_max=env_int(env, "GATE_RESERVATION_INFLIGHT_MAX", 1024, 1, 1_000_000),
        reservation_group_max=env_int(env, "GATE_RESERVATION_GROUP_MAX", 64, 1, 512),
        reservation_groups_in_flight_max=env_int(
            env, "GATE_RESERVATION_GROUPS_IN_FLIGHT_MAX", 2, 1, 64
        ),
        redis_pipeline_max=env_int(env, "GATE_REDIS_PIPELINE_MAX", 512, 1, 100_000),
        redis_flush_every=env_int(env, "GATE_REDIS_FLUSH_EVERY", 0, 0, 100_000),
        gc_gen0_threshold=env_int(env, "GATE_GC_GEN0_THRESHOLD", 50_000, 0, 10_000_000),
        idempotency_ttl_seconds=env_int(env, "GATE_IDEMPOTENCY_TTL_SECONDS", 86_400, 86_400, 10**8),
        inflight_max_seconds=env_float(env, "GATE_INFLIGHT_MAX_SECONDS", 30.0, 0.5, 3600),
        janitor_batch_max=env_int(env, "GATE_JANITOR_BATCH_MAX", 500, 1, 100_000),
        janitor_interval_seconds=env_float(env, "GATE_JANITOR_INTERVAL_SECONDS", 1.0, 0.05, 60),
        background_lease_seconds=env_float(env, "GATE_BACKGROUND_LEASE_SECONDS", 5.0, 0, 60),
        janitor_committed_after_seconds=env_float(
            env, "GATE_JANITOR_COMMITTED_AFTER_SECONDS", 2.0, 0.1, 3600
        ),
        lease_seconds=env_float(env, "GATE_LEASE_SECONDS", 3.0, 0.3, 60),
        resync_interval_seconds=env_float(env, "GATE_RESYNC_INTERVAL_SECONDS", 1.0, 0.05, 60),
        resync_quiet_seconds=env_float(env, "GATE_RESYNC_QUIET_SECONDS", 15.0, 0, 600),
        jwt_cache_max=env_int(env, "GATE_JWT_CACHE_MAX", 65_536, 0, 10_000_000),
        jwt_hs256=secrets.jwt_hs256,
        jwt_idp=secrets.jwt_idp,
        sold_out_cache_seconds=env_int(env, "GATE_SOLD_OUT_CACHE_MS", 100, 0, 1000) / 1000,
        body_max_bytes=4096,
        body_timeout_seconds=env_float(env, "GATE_BODY_TIMEOUT_SECONDS", 5.0, 0.1, 300),
        http_concurrency_max=env_int(env, "GATE_HTTP_CONCURRENCY_MAX", 1024, 1, 100_000),
        worker_timeout_seconds=env_float(env, "GATE_WORKER_TIMEOUT_SECONDS", 30.0, 1.0, 3600),
        shutdown_delay_seconds=env_float(env, "GATE_SHUTDOWN_DELAY_SECONDS", 5.0, 0, 300),
        shutdown_grace_seconds=env_float(env, "GATE_SHUTDOWN_GRACE_SECONDS", 10.0, 0.1, 600),
        docs=env_bool(env, "GATE_DOCS", dev),
        metrics_addr=parse_listen_address("GATE_METRICS_ADDR", metrics_raw)
        if metrics_raw.strip()
        else None,
        metrics_addr_from_port=not metrics_raw.strip(),
        run_background=env_bool(env, "GATE_BACKGROUND", True),
        auto_migrate=env_bool(env, "GATE_AUTO_MIGRATE", True),
        log_level=log_level,
        environ=MappingProxyType(dict(env)),
    )
    _check_inflight_max(settings)
    return settings
