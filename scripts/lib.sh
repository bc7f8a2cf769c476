# Shared set-up steps for scripts/run and scripts/test (sourced, not executed).
#
# ensure_venv      create .venv and install the project when needed, with the locked
#                  versions of requirements-dev.lock (GATE_DEPS=newest: without the lock);
#                  `ensure_venv PYTHON DIR`: the same with another interpreter, in DIR
# find_python      an interpreter of a given minor version (python3.13 on PATH, pyenv, uv)
# ensure_services  make Redis and MariaDB answer at GATE_REDIS_URL / GATE_MYSQL_URL:
#                  use what answers there, otherwise start local instances on
#                  loopback with their own data directory under .local/, installing
#                  redis-server / mariadb-server with apt-get when missing.
# ensure_galera    what tests/galera.py needs for a local MariaDB Galera cluster
#                  (mariadb-server, galera-4, rsync), installed with apt-get when missing

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${GATE_VENV:-$ROOT/.venv}
STATE=${GATE_STATE_DIR:-$ROOT/.local}
export GATE_REDIS_URL=${GATE_REDIS_URL:-redis://127.0.0.1:6379/0}
export GATE_MYSQL_URL=${GATE_MYSQL_URL:-mysql://root@127.0.0.1:3306/gate}

say() { printf '==> %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else say "need root to run: $*"; return 1
  fi
}

apt_install() {
  say "installing Debian packages: $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_venv() {
  local python=${1:-python3} venv=${2:-$VENV}
  if [ "$python" = python3 ] && ! command -v python3 >/dev/null 2>&1; then apt_install python3; fi
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "Python >= 3.11 is required (found $("$python" --version 2>&1))"; return 1
  fi
  if [ ! -x "$venv/bin/python" ]; then
    say "creating virtualenv in $venv ($("$python" --version 2>&1))"
    if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
      rm -rf "$venv"
      # Debian splits venv (and the ensurepip it needs) out of each interpreter.
      if [ "$python" = python3 ]; then apt_install python3-venv || return 1
      else apt_install "python$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv" || return 1
      fi
      "$python" -m venv "$venv" || return 1
    fi
  fi
  local stamp="$venv/.gate-installed"
  if [ "${GATE_DEPS:-locked}" = newest ]; then
    # scripts/test --upgrade: the newest releases pyproject.toml's ranges allow, without
    # the lock, in a virtualenv of its own (re-resolved on every run).
    say "installing gate with the newest releases of its dependencies (no lock) into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null || return 1
    "$venv/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e "$ROOT[dev]" \
      || return 1
    "$venv/bin/python" -m pip freeze --exclude-editable >"$venv/versions.txt" || return 1
    say "versions under test: $venv/versions.txt"
    return 0
  fi
  if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] \
      || [ "$ROOT/requirements-dev.lock" -nt "$stamp" ]; then
    # Exactly the versions the suite runs on, every file checked against its hash
    # (requirements-dev.lock, written by scripts/lock; one lock for every supported
    # Python); then the gate itself.
    say "installing gate and its locked dependencies (requirements-dev.lock) into $venv"
    # (`|| return 1` on each step: callers may run this under `if`, where set -e is off,
    # and a failed install must not be stamped as done.)
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null || return 1
    "$venv/bin/python" -m pip install -q --require-hashes -r "$ROOT/requirements-dev.lock" \
      || return 1
    "$venv/bin/python" -m pip install -q --no-deps -e "$ROOT" || return 1
    touch "$stamp"
  fi
}

# find_python 3.13 -> the path of a Python 3.13 interpreter, or nothing (status 1).
# Looks for python3.13 on PATH (Debian's, or a pyenv shim that is active), then in
# pyenv's versions, then asks uv; each candidate is run, so a shim of an inactive
# pyenv version or a broken link does not count.
find_python() {
  local want=$1 candidate found
  local candidates=("python$want" "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want".*/bin/"python$want")
  if command -v uv >/dev/null 2>&1 && found=$(uv python find "$want" 2>/dev/null); then
    candidates+=("$found")
  fi
  for candidate in "${candidates[@]}"; do
    if found=$("$candidate" -c 'import sys
if "%d.%d" % sys.version_info[:2] == sys.argv[1]: print(sys.executable)' "$want" 2>/dev/null) \
        && [ -n "$found" ]; then
      printf '%s\n' "$found"; return 0
    fi
  done
  return 1
}

# url_part URL field -> host | port | db, with defaults for the scheme.
url_part() {
  python3 - "$1" "$2" <<'PY'
import sys
from urllib.parse import urlsplit
u = urlsplit(sys.argv[1])
default = 6379 if u.scheme.startswith("redis") else 3306
print({"host": u.hostname or "127.0.0.1", "port": u.port or default}[sys.argv[2]])
PY
}

is_loopback() { case "$1" in 127.*|localhost|::1) return 0;; *) return 1;; esac; }

# Probes run in a child shell: a failed `exec 3<>/dev/tcp/…` makes a
# non-interactive shell exit, which must not take the set-up script with it.
redis_answers() {
  timeout 3 bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 1
    printf "PING\r\n" >&3
    read -r -t 2 reply <&3 || exit 1
    case "$reply" in +PONG*|-NOAUTH*) exit 0;; *) exit 1;; esac
  ' probe "$1" "$2" 2>/dev/null
}

mysql_answers() {
  timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' probe "$1" "$2" 2>/dev/null
}

wait_for() {
  local what=$1; shift
  for _ in $(seq 1 60); do
    if "$@"; then return 0; fi
    sleep 0.5
  done
  say "$what did not come up"; return 1
}

ensure_redis() {
  local host port
  host=$(url_part "$GATE_REDIS_URL" host); port=$(url_part "$GATE_REDIS_URL" port)
  if redis_answers "$host" "$port"; then return 0; fi
  if ! is_loopback "$host"; then say "Redis at $host:$port does not answer"; return 1; fi
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server
  mkdir -p "$STATE/redis"
  say "starting a local Redis on 127.0.0.1:$port (data in $STATE/redis)"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --dir "$STATE/redis" \
    --save "" --appendonly no --maxmemory-policy noeviction \
    --logfile "$STATE/redis/redis.log" --pidfile "$STATE/redis/redis.pid"
  wait_for "Redis" redis_answers "$host" "$port"
}

ensure_mariadb() {
  local host port
  host=$(url_part "$GATE_MYSQL_URL" host); port=$(url_part "$GATE_MYSQL_URL" port)
  if mysql_answers "$host" "$port"; then return 0; fi
  if ! is_loopback "$host"; then say "MariaDB at $host:$port does not answer"; return 1; fi
  if ! command -v mariadbd >/dev/null 2>&1 && [ ! -x /usr/sbin/mariadbd ]; then
    apt_install mariadb-server
  fi
  local data="$STATE/mariadb/data" user
  user=$(id -un)
  mkdir -p "$STATE/mariadb"
  if [ ! -d "$data/mysql" ]; then
    say "initialising a local MariaDB data directory in $data"
    # --no-defaults: the system my.cnf (user, log paths) belongs to the system server.
    if ! mariadb-install-db --no-defaults --datadir="$data" --user="$user" \
        --auth-root-authentication-method=normal --skip-test-db \
        >"$STATE/mariadb/install.log" 2>&1; then
      tail -20 "$STATE/mariadb/install.log" >&2
      rm -rf "$data"
      say "mariadb-install-db failed"; return 1
    fi
  fi
  say "starting a local MariaDB on 127.0.0.1:$port (data in $data)"
  local mariadbd_bin
  mariadbd_bin=$(command -v mariadbd || echo /usr/sbin/mariadbd)
  setsid "$mariadbd_bin" --no-defaults --datadir="$data" --user="$user" \
    --bind-address=127.0.0.1 --port="$port" --socket="$STATE/mariadb/mysqld.sock" \
    --pid-file="$STATE/mariadb/mysqld.pid" --log-error="$STATE/mariadb/error.log" \
    --innodb-buffer-pool-size=256M --max-connections=500 </dev/null >/dev/null 2>&1 &
  if ! wait_for "MariaDB" mysql_answers "$host" "$port"; then
    tail -20 "$STATE/mariadb/error.log" >&2; return 1
  fi
}

ensure_services() {
  ensure_redis
  ensure_mariadb
}

ensure_galera() {
  local missing=()
  if ! command -v mariadb-install-db >/dev/null 2>&1 \
      || { ! command -v mariadbd >/dev/null 2>&1 && [ ! -x /usr/sbin/mariadbd ]; }; then
    missing+=(mariadb-server)
  fi
  [ -f /usr/lib/galera/libgalera_smm.so ] || missing+=(galera-4)
  command -v rsync >/dev/null 2>&1 || missing+=(rsync)
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
}

# promtool checks the alert rules (tests/project/test_ops_monitoring.py). Debian 13 ships
# it as the package promtool; Debian 12 only inside the prometheus package, which would
# also install a server. So the package is downloaded (promtool, else prometheus) and
# just the one binary unpacked under $STATE/bin.
ensure_promtool() {
  if [ -n "${PROMTOOL:-}" ] || command -v promtool >/dev/null 2>&1; then return 0; fi
  local bin="$STATE/bin/promtool"
  if [ ! -x "$bin" ]; then
    local tmp
    tmp=$(mktemp -d)
    say "unpacking promtool from Debian's promtool or prometheus package"
    download_promtool() {
      apt-get download promtool >/dev/null 2>&1 || apt-get download prometheus >/dev/null 2>&1
    }
    if (cd "$tmp" && { download_promtool || { as_root apt-get update -qq && download_promtool; }; } \
        && dpkg-deb -x ./*.deb x && mkdir -p "$STATE/bin" \
        && cp x/usr/bin/promtool "$bin"); then :
    else say "promtool could not be fetched; the alert-rule tests will be skipped"; fi
    rm -rf "$tmp"
  fi
  if [ -x "$bin" ]; then export PROMTOOL="$bin"; fi
}

# The rolling-restart test (tests/cli/test_rolling_restart.py) puts two gates behind
# Debian's HAProxy; when it cannot be installed the test skips with a message saying so.
ensure_haproxy() {
  if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then return 0; fi
  apt_install haproxy || say "haproxy could not be installed; the rolling-restart test will be skipped"
}

# The console's browser tests (tests/console/test_console_browser.py) drive Debian's
# chromium with chromium-driver through Selenium; nothing is downloaded at test
# time. The two packages are ~100 MB and take 1-2 minutes to install on a fresh
# Debian image (once: a second run finds them); when they cannot be installed the
# browser tests skip with a message saying so.
ensure_chromium() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    return 0
  fi
  apt_install chromium chromium-driver \
    || say "chromium/chromium-driver could not be installed; the console's browser tests will be skipped"
}
