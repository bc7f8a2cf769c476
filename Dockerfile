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

# -- build: resolve and install every dependency into a virtualenv ---------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
# The locked versions first, every file checked against its hash (requirements.lock,
# written by scripts/lock): this layer is rebuilt only when the lock changes.
COPY requirements.lock ./
RUN /opt/venv/bin/pip install --require-hashes -r requirements.lock
COPY pyproject.toml README.md ./
COPY gate ./gate
RUN /opt/venv/bin/pip install --no-deps . \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

# -- runtime: the virtualenv, the Lua scripts and the migrations; no compilers ---------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="gate" \
      org.opencontainers.image.description="Redis-fronted admission gate for flash sales"
RUN groupadd --system --gid 10001 gate \
    && useradd --system --uid 10001 --gid gate --no-create-home --home-dir /app \
       --shell /usr/sbin/nologin gate
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY lua ./lua
COPY db ./db
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATE_LUA_DIR=/app/lua \
    GATE_DB_DIR=/app/db
# Numeric, so orchestrators can verify runAsNonRoot.
USER 10001:10001
EXPOSE 8000
# /healthz does no I/O: it says the process serves, not that Redis or the database
# answer (that is /readyz, for load balancers and readiness probes).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
