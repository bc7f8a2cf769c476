"""The running gate: settings, connections and services, started and stopped together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from gate.base.settings import Settings
from gate.extensions import Extension, area_modules
from gate.inventory.deals import Deals
from gate.inventory.janitor import Janitor
from gate.inventory.mirror import Mirror
from gate.inventory.resync import Resync
from gate.inventory.unknown_deals import UnknownDeals
from gate.reserve.path import ReservationPath
from gate.reserve.ports import QueuedOrders
from gate.reserve.soldout import SoldOutCache
from gate.store.db import Database
from gate.store.dbwriter import NoWriter
from gate.store.migrate import pending
from gate.store.process_lease import Lease
from gate.store.redis_mode import detect_mode, make_redis
from gate.store.scripts import ScriptRunner, read_scripts
from gate.store.work_lease import WorkLease
from gate.web.auth import AdminAuth, BuyerAuth
from gate.web.jwks import JwksError, JwksKeys

log = logging.getLogger("gate")


class StartupError(RuntimeError):
    pass


def _plug(extensions: list[Extension], name: str) -> Any:
    """The one area's plug of that name, or None when no area gives it."""
    given = [getattr(ext, name) for ext in extensions if getattr(ext, name) is not None]
    if len(given) > 1:
        raise StartupError(f"two areas give the reservation path's {name}")
    return given[0] if given else None


class Gate:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # Read the scripts now: a missing script must stop start-up before any socket opens.
        scripts = read_scripts()
        self.db = Database(settings)
        # "standalone" or "cluster" (GATE_REDIS_MODE=auto asks the node once).
        nodes = settings.redis_cluster_nodes
        self.redis_mode = detect_mode(
            settings.redis_url, settings.redis_mode, settings.redis_timeout_seconds, nodes
        )
        self.redis = make_redis(
            settings.redis_url,
            settings.redis_pool_max,
            settings.redis_timeout_seconds,
            self.redis_mode,
            nodes,
        )
        self.runner = ScriptRunner(
            self.redis,
            scripts,
            settings.redis_pipeline_max,
            settings.redis_url,
            settings.redis_timeout_seconds,
            mode=self.redis_mode,
            flush_every=settings.redis_flush_every,
            nodes=nodes,
        )
        self.mirror = Mirror(settings, self.db, self.redis, self.runner)
        self.soldout = SoldOutCache(self.redis, self.runner, settings.sold_out_cache_seconds)
        # One memory of unknown deal ids for the deal views and the reservations.
        self.unknown_deals = UnknownDeals(self.redis, self.db)
        self.lease = Lease(settings, self.runner, self.db)
        self.deals = Deals(self.db, self.mirror, self.unknown_deals)
        idp = settings.jwt_idp
        # The identity provider's keys, refreshed in the background (gate/web/jwks.py).
        self.jwks = (
            JwksKeys(file=idp.jwks_file, url=idp.jwks_url, refresh_seconds=idp.refresh_seconds)
            if idp is not None
            else None
        )
        self.buyer_auth = BuyerAuth(
            settings.jwt_secret if settings.jwt_hs256 else None,
            settings.jwt_cache_max,
            jwks=self.jwks,
            issuer=idp.issuer if idp is not None else None,
            audience=idp.audience if idp is not None else None,
        )
        self.admin_auth = AdminAuth(settings.admin_token)
        self.janitor = Janitor(settings, self.db, self.redis, self.mirror)
        self.resync = Resync(settings, self.redis, self.mirror)
        # Each background loop runs in one process at a time across hosts.
        ttl = settings.background_lease_seconds
        self.janitor.work_lease = WorkLease(self.runner, "janitor", ttl)
        self.resync.work_lease = WorkLease(self.runner, "resync", ttl)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease_task: asyncio.Task[None] | None = None
        # Areas install after the core services above, which they may use, and before
        # the reservation path, which is built with the plugs they hand over.
        self.extensions: list[Extension] = [module.install(self) for module in area_modules()]
        for ext in self.extensions:
            self.runner.scripts.update(ext.scripts)
            self.mirror.before_sync.extend(ext.before_sync)
        # An order waiting in queue mode's queue, for the order view and cancel.
        self.queue: QueuedOrders | None = _plug(self.extensions, "queued_orders")
        self.reservations = ReservationPath(
            settings,
            self.db,
            self.mirror,
            self.soldout,
            self.unknown_deals,
            self.lease,
            admission=_plug(self.extensions, "admission"),
            queue=_plug(self.extensions, "queue"),
        )

    async def start(self, *, background: bool | None = None) -> None:
        if self.settings.dev_secrets_used:
            log.warning(
                "GATE_ENV=dev: using built-in development values for %s; never run like this"
                " in production",
                ", ".join(self.settings.dev_secrets_used),
            )
        try:
            left = await pending(self.settings.mysql, self.settings.db_connect_timeout_seconds)
            if left:
                raise StartupError(
                    f"database schema is not current (pending: {left}); run gate migrate"
                )
            # Chooses the writer node and starts probing the nodes (gate/store/dbwriter.py).
            await self.db.start()
        except NoWriter as exc:
            raise StartupError(str(exc)) from None
        await self.runner.load()
        if self.jwks is not None:
            try:
                await self.jwks.load()
            except JwksError as exc:
                raise StartupError(str(exc)) from None
            self._spawn(self.jwks.run(self._stop))
        # Before any request: every admission token names this process's lease.
        await self.lease.start()
        self._lease_task = asyncio.get_running_loop().create_task(self.lease.run())
        for ext in self.extensions:
            for hook in ext.on_start:
                await hook()
        # Every serving process gives back its own admissions that will never commit.
        self._spawn(self.reservations.givebacks.run(self._stop))
        self._spawn(self.reservations.breakers.probe(self._stop))
        run_background = self.settings.run_background if background is None else background
        if run_background:
            self._spawn(self.janitor.run(self._stop))
            self._spawn(self.resync.run(self._stop))
            for ext in self.extensions:
                for worker in ext.workers:
                    self._spawn(worker(self._stop))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def stop(self) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for ext in reversed(self.extensions):
            for hook in ext.on_stop:
                try:
                    await hook()
                except Exception:
                    log.exception("stopping %s failed", ext.name)
        # Groups still in the database finish before their pool closes.
        await self.reservations.aclose()
        await self.soldout.aclose()
        await self.unknown_deals.aclose()
        await self.db.close()
        # Renewed until the pool is closed (no transaction of ours can run any more),
        # then released: markers left behind are resolved at once.
        if self._lease_task is not None:
            await self.lease.stop()
            await self._lease_task
        await self.runner.aclose()
        await self.redis.aclose()
