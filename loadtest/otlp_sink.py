"""An OTLP/HTTP endpoint that takes every export and drops it, in a process of its own
(so that a benchmark's CPU figures hold the gate's tracing cost, exporting included,
and none of the receiver's):

    python -m loadtest.otlp_sink [--port 0]     prints "port N", then serves

`POST /v1/traces` is answered 200 with an empty `ExportTraceServiceResponse` (zero
bytes of protobuf) after its body is read; it counts what it took (`GET /stats`).
`running_sink()` starts one on a free loopback port for the benchmark's duration.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson


def serve(port: int) -> None:
    stats = {"exports": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            stats["bytes"] += len(self.rfile.read(length))
            stats["exports"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            body = orjson.dumps(stats)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


def tracing_env(endpoint: str, ratio: float) -> dict[str, str]:
    """OTEL_* for a gate tracing at `ratio` (of the traces it starts) to `endpoint`."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(ratio),
        "OTEL_SERVICE_NAME": "gate-benchmark",
    }


@contextlib.contextmanager
def running_sink() -> Iterator[str]:
    """The endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) of a sink process, stopped after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.otlp_sink", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"the OTLP sink did not start: {line!r}")
        yield f"http://127.0.0.1:{line[1]}"
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    serve(p.parse_args().port)


if __name__ == "__main__":
    main()
