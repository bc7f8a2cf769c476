"""Helpers for the operability tests: gate processes started the way `gate serve`
prepares them for several workers, and metric scraping."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp
from prometheus_client.mmap_dict import MmapedDict

from gate.base.metrics import (
    METRICS_DIR_ENV,
    MULTIPROC_ENV,
    TALLY_FLUSH_SECONDS,
    prepare_multiprocess,
    sample_values,
)
from tests.support import Client

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def multiprocess_env(base: Mapping[str, str], metrics_dir: Path, workers: int) -> dict[str, str]:
    """The environment the `gate serve` parent gives its workers (via the same helper)."""
    env = {k: v for k, v in base.items() if k != MULTIPROC_ENV}
    env[METRICS_DIR_ENV] = str(metrics_dir)
    path = prepare_multiprocess(workers, env)
    assert path == str(metrics_dir) and env[MULTIPROC_ENV] == path
    return env


class FreshConnectionClient(Client):
    """A client that opens a new connection for every request.

    Workers share one listening socket and each accepts every connection queued when
    it wakes; pooled keep-alive connections would all stay with the worker that won
    the first race. One connection per request spreads requests over the workers.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=8),
            timeout=aiohttp.ClientTimeout(total=60),
        )


async def scrape(client: Client) -> Samples:
    """The samples of the client's gate, from its metrics listener."""
    return sample_values(await client.metrics())


async def scrape_until(
    client: Client, check: Callable[[Samples], bool], timeout_seconds: float = 10.0
) -> Samples:
    """Scrapes until `check` holds, then those samples (the last ones if it never
    does). Under several workers each adds its tallies to its file every
    TALLY_FLUSH_SECONDS, so a scrape may miss the last quarter second."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        samples = await scrape(client)
        if check(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(TALLY_FLUSH_SECONDS / 2)


def per_process_values(metrics_dir: Path, name: str, **labels: str) -> dict[int, float]:
    """{pid: value} of one counter series, read from each process's metric file."""
    out: dict[int, float] = {}
    want = set(labels.items())
    for path in glob.glob(os.path.join(metrics_dir, "counter_*.db")):
        pid = int(os.path.basename(path)[len("counter_") : -len(".db")])
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(path):
            _metric, sample, lab, _help = json.loads(key)
            if sample == name and want <= set(lab.items()):
                out[pid] = out.get(pid, 0.0) + value
    return out
