# syntax=docker/dockerfile:1
# Gate: a slim two-stage image running `gate serve` as an unprivileged user.
#
#   docker build -t gate .
#   docker run -p 8000:8000 -e GATE_REDIS_URL=redis://… -e GATE_MYSQL_URL=mysql://… \
#     -e GATE_JWT_SECRET=… -e GATE_ADMIN_TOKEN=… -e GATE_WEBHOOK_SECRET=whsec_… -e GATE_ADMISSION_SECRET=… gate
#
# Outside GATE_ENV=dev the built-in development secrets are refused. The whole stack
# (Redis, MariaDB, a one-shot migrate, Prometheus, Grafana) is docker-compose.yml; the
# local demo with the sandbox provider is docker-compose.dev.yml; docs/operations.md
# ("Deploying safely") describes them.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the wheel, from the files the release is made of (docs/releasing.md) -------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE MANIFEST.in CHANGELOG.md ./
COPY gate ./gate
COPY lua ./lua
COPY db ./db
# gate-X.Y.Z-py3-none-any.whl, carrying the Lua scripts and migrations as package data.
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# -- runtime: the locked dependencies, then the wheel; no compilers, no build tree -----
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="gate" \
      org.opencontainers.image.description="Redis-fronted admission gate for flash sales" \
      org.opencontainers.image.licenses="MIT"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 gate \
    && useradd --system --uid 10001 --gid gate --no-create-home --home-dir /app \
       --shell /usr/sbin/nologin gate \
    && python -m venv /opt/venv
# The locked versions first, every file checked against its hash (requirements.lock,
# written by scripts/lock): this layer is rebuilt only when the lock changes.
COPY requirements.lock /tmp/requirements.lock
RUN pip install --require-hashes -r /tmp/requirements.lock && rm /tmp/requirements.lock
# Then the wheel with no index: the lock must already hold everything it depends on.
# Bytecode compiled now, as root: the image may run with a read-only root filesystem.
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-index /tmp/wheels/gate-*.whl \
    && pip check \
    && rm -rf /tmp/wheels \
    && python -m compileall -q /opt/venv/lib
WORKDIR /app
# Numeric, so orchestrators can verify runAsNonRoot.
USER 10001:10001
# 8000: the public port. 18000: the metrics listener, the default for --port 8000
# (--port + 10000), on the container's loopback unless GATE_METRICS_ADDR says
# otherwise (docker-compose.yml and deploy/kubernetes set 0.0.0.0:18000).
EXPOSE 8000 18000
# /healthz does no I/O: it says the process serves, not that Redis or the database
# answer (that is /readyz, for load balancers and readiness probes).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
