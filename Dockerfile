# Gate: slim multi-stage image running `gate serve`.
#   docker build -t gate . && docker run -p 8000:8000 -e GATE_REDIS_URL=… -e GATE_MYSQL_URL=… gate
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gate ./gate
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 gate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
WORKDIR /app
COPY lua ./lua
COPY db ./db
ENV GATE_LUA_DIR=/app/lua \
    GATE_DB_DIR=/app/db \
    PYTHONUNBUFFERED=1
USER gate
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"
ENTRYPOINT ["gate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
