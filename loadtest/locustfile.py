"""Locust scenarios for the gate (FastHttpUser). Run them through `loadtest/run`, or:

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \\
        -u 200 -r 100 -t 30s --csv out/stats --html out/report.html \\
        --record out/client.json FlashSaleBuyer DuplicateClicker Reader

Buyers mint their own tokens (HS256 with GATE_JWT_SECRET). Deals are created through
the admin API (GATE_ADMIN_TOKEN) at the start of the run unless their ids are given.

User classes (each a scenario; mix them by naming several):
  FlashSaleBuyer    a crowd of new buyers, one click each with a fresh key, retrying the
                    same key after 429/503 or no answer, until the deal sells out and after
  DuplicateClicker  double and triple clicks sent concurrently with one key, then a
                    retry: at most one 201 and one order id per key
  Reader            buyers polling their own order and the deal; peeking at another
                    buyer's order must answer 404
  PayingBuyer       (needs payments) reserve, open the payment session twice
                    (idempotent), then signed callbacks duplicated and reordered;
                    the order must end PAID
  QueueBuyer        queue mode: a crowd on a deal in queue mode; every 202 is
                    polled until it reads PENDING_PAYMENT (within 10 s)
  LatePayer         (needs payments and the expiry sweeper) short holds that
                    expire while the buyer pays; the late payment must end PAID
                    (stock re-taken) or REFUND_PENDING/REFUNDED
  WaitingRoomBuyer  joins a deal's waiting room (solving its proof-of-work challenge
                    first when the room asks one: --room-min-bits/--room-max-bits
                    give the room it creates one), polls as advised,
                    reserves with its admission token once admitted, or abandons a
                    share of the admissions (they lapse and return their slot); a
                    position that grows while waiting, an admitted ticket without
                    a token or a reservation refused for its admission is a violation

A run writes the client record (--record) that `python -m loadtest.verify` checks.

Callbacks are delivered as a provider delivers them, at least once: every delivery and
the answer it got (its HTTP status, 0 for none) go into the record, and an event no
copy of which got a 2xx is delivered again (same webhook-id, signed afresh), at most
DELIVERY_ATTEMPTS_MAX times. A keep-alive connection the gate closes as a request
leaves on it (uvicorn closes one idle for 5 s) answers nothing: that request never
reached the gate, and a provider would send it again. Only a payment the gate answered
2xx counts as paid; one that never got a 2xx is recorded as unpaid, not as paid.

    reserve -> session x2 -> [late: sleep past the hold] -> deliver copies at once
        -> any 2xx? yes: paid / late_paid
                    no:  pause, deliver again (<= DELIVERY_ATTEMPTS_MAX rounds)
                         -> still none: unpaid (a locust failure)
"""

from __future__ import annotations

import itertools
import logging
import random
import secrets
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gevent
import orjson
from gevent.pool import Group
from locust import FastHttpUser, between, events, task
from locust.exception import StopUser
from locust.runners import WorkerRunner

from gate.room.gates import solve
from loadtest import webhooks
from loadtest.record import NO_ANSWER, ORDERS_MAX, ClientRecord, OrderRef, acknowledged
from loadtest.tokens import TokenMint

log = logging.getLogger("loadtest")

RETRIES_MAX = 3
RETRY_PAUSE_MAX_SECONDS = 2.0
PAID_WAIT_SECONDS = 8.0
# Rounds of delivery of one event until a copy gets a 2xx, and the pause before the
# next round (times the round number): what a provider's redelivery does, bounded.
DELIVERY_ATTEMPTS_MAX = 4
REDELIVERY_PAUSE_SECONDS = 0.5
LATE_END_WAIT_SECONDS = 15.0
STATES = (
    "PENDING_PAYMENT",
    "AUTHORIZED",
    "PAID",
    "EXPIRED",
    "CANCELLED",
    "REFUND_PENDING",
    "REFUNDED",
)
LATE_ENDS = ("PAID", "REFUND_PENDING", "REFUNDED")
# Which deal each user class buys from, and how that deal is created when no id is given.
ROLES = {
    "FlashSaleBuyer": "flash",
    "DuplicateClicker": "flash",
    "Reader": "reader",
    "PayingBuyer": "pay",
    "LatePayer": "late",
    "WaitingRoomBuyer": "room",
    "QueueBuyer": "queue",
}
PAYMENT_CLASSES = ("PayingBuyer", "LatePayer")
# The detail of the gate's 503 when GATE_PAYMENT_PROVIDER_URL is unset.
NO_PROVIDER = "No payment provider is configured"


class Run:
    """State shared by every user of this process."""

    def __init__(self) -> None:
        self.record = ClientRecord()
        self.mint: TokenMint | None = None
        self.webhook_key: bytes | None = None
        self.payments = False
        self.provider = "sandbox"
        self.pay_via = "direct"
        self.sandbox_api_key: str | None = None
        self.run_tag = format(int(time.time() * 1000) % 36**8, "x")
        self.users = itertools.count(1)
        self.user_base = 0
        self.options: Any = None
        self.seen: set[str] = set()

    def order_seen(self, order_id: str, user: int, deal_id: int) -> None:
        """Remember an order a client was told about (201, or a replay of a lost 201)."""
        if order_id not in self.seen:
            if len(self.seen) < ORDERS_MAX:
                self.seen.add(order_id)
            self.record.add(self.record.created, (order_id, user, deal_id))

    def next_user(self) -> int:
        return self.user_base + next(self.users)

    def deal(self, role: str) -> int:
        deal_id = self.record.deals.get(role)
        if deal_id is None:
            raise StopUser()
        return deal_id


# A queued order must read PENDING_PAYMENT within this (10 s).
QUEUE_SETTLE_SECONDS = 10.0

RUN = Run()


# -- options and set-up ---------------------------------------------------------------------


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    g = parser.add_argument_group("gate")
    g.add_argument("--jwt-secret", env_var="GATE_JWT_SECRET", default="", help="buyer token key")
    g.add_argument("--admin-token", env_var="GATE_ADMIN_TOKEN", default="", help="to create deals")
    g.add_argument(
        "--webhook-secret", env_var="GATE_WEBHOOK_SECRET", default="", help="whsec_… for callbacks"
    )
    g.add_argument("--provider", env_var="LOADTEST_PROVIDER", default="sandbox")
    g.add_argument(
        "--pay-via",
        env_var="LOADTEST_PAY_VIA",
        choices=("direct", "sandbox"),
        default="direct",
        help="direct: sign and send callbacks ourselves; sandbox: pay on the sandbox's pay"
        " step (its redirect_url) and let it deliver the callbacks",
    )
    g.add_argument(
        "--sandbox-url",
        env_var="LOADTEST_SANDBOX_URL",
        default="",
        help="with --pay-via sandbox: set its delivery controls (duplicates, reorder window)",
    )
    g.add_argument(
        "--sandbox-api-key",
        env_var="GATE_SANDBOX_API_KEY",
        default="",
        help="with --sandbox-url: the sandbox's API key (its /sandbox/* controls need it)",
    )
    g.add_argument(
        "--sandbox-duplicates", type=int, env_var="LOADTEST_SANDBOX_DUPLICATES", default=2
    )
    g.add_argument(
        "--sandbox-reorder-seconds", type=float, env_var="LOADTEST_SANDBOX_REORDER", default=0.5
    )
    g.add_argument("--record", env_var="LOADTEST_RECORD", default="", help="client record path")
    g.add_argument("--user-base", type=int, env_var="LOADTEST_USER_BASE", default=0)
    for role in ("flash", "reader", "pay", "late", "room", "queue"):
        g.add_argument(
            f"--{role}-deal", type=int, env_var=f"LOADTEST_{role.upper()}_DEAL", default=0
        )
    g.add_argument("--stock", type=int, env_var="LOADTEST_STOCK", default=200)
    g.add_argument("--buckets", type=int, env_var="LOADTEST_BUCKETS", default=4)
    g.add_argument("--late-hold-seconds", type=int, env_var="LOADTEST_LATE_HOLD", default=2)
    g.add_argument(
        "--room-rate", type=int, env_var="LOADTEST_ROOM_RATE", default=100, help="admits/s"
    )
    g.add_argument(
        "--room-abandon",
        type=float,
        env_var="LOADTEST_ROOM_ABANDON",
        default=0.2,
        help="share of admitted buyers who never reserve",
    )
    g.add_argument(
        "--room-min-bits",
        type=int,
        env_var="LOADTEST_ROOM_MIN_BITS",
        default=-1,
        help="the room's challenge min_bits (-1: no challenge)",
    )
    g.add_argument(
        "--room-max-bits",
        type=int,
        env_var="LOADTEST_ROOM_MAX_BITS",
        default=-1,
        help="the room's challenge max_bits (at least min_bits)",
    )


def _admin_post(host: str, token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        host.rstrip("/") + path, data=orjson.dumps(body), method="POST", headers=headers
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        result: dict[str, Any] = orjson.loads(resp.read())
        return result


def _room_challenge(opts: Any) -> dict[str, int] | None:
    low = int(getattr(opts, "room_min_bits", -1))
    if low < 0:
        return None
    return {"min_bits": low, "max_bits": max(low, int(opts.room_max_bits))}


def _deal_body(role: str, opts: Any, users: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "title": f"loadtest {role} {RUN.run_tag}",
        "unit_price": 1999,
        "currency": "EUR",
        "max_per_order": 1,
        "hold_seconds": 600,
    }
    if role == "flash":
        body.update(stock=opts.stock, buckets=opts.buckets)
    elif role == "room":
        body.update(
            stock=opts.stock,
            buckets=opts.buckets,
            waiting_room={
                "admit_per_second": opts.room_rate,
                "admission_ttl_seconds": 10,
                "challenge": _room_challenge(opts),
            },
        )
    elif role == "queue":
        body.update(stock=opts.stock, buckets=opts.buckets, mode="queue")
    elif role == "late":
        body.update(stock=max(100, 20 * users), buckets=4, hold_seconds=opts.late_hold_seconds)
    else:
        body.update(stock=max(1000, 50 * users), buckets=4)
    return body


def _payments_available(host: str, provider: str) -> bool:
    """Whether the gate has the callback endpoint: an unsigned empty event is refused
    (400/401) by a gate that has it and answered 404 by one that does not."""
    request = urllib.request.Request(
        f"{host.rstrip('/')}/v1/payments/{provider}/webhook",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 404


@events.test_start.add_listener
def _start(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    RUN.options = opts
    RUN.record.host = environment.host or ""
    RUN.provider = opts.provider
    RUN.user_base = opts.user_base or (int(time.time()) % 10**7) * 10**6
    RUN.mint = TokenMint(opts.jwt_secret, ttl_seconds=6 * 3600)
    if opts.webhook_secret:
        RUN.webhook_key = webhooks.secret_key(opts.webhook_secret)
    classes = {cls.__name__ for cls in environment.user_classes}
    roles = sorted({ROLES[c] for c in classes if c in ROLES})
    users = int(getattr(opts, "num_users", 0) or 100)
    for role in roles:
        given = int(getattr(opts, f"{role}_deal"))
        if given:
            RUN.record.deals[role] = given
        elif isinstance(environment.runner, WorkerRunner):
            log.error("distributed runs need --%s-deal: workers cannot share created deals", role)
        elif not opts.admin_token:
            log.error("no --%s-deal and no admin token to create one", role)
        else:
            body = _deal_body(role, opts, users)
            created = _admin_post(RUN.record.host, opts.admin_token, "/v1/admin/deals", body)
            RUN.record.deals[role] = int(created["id"])
            RUN.record.stocks[int(created["id"])] = int(body["stock"])
            log.info("created %s deal %s", role, created["id"])
    if classes & set(PAYMENT_CLASSES):
        RUN.pay_via = opts.pay_via
        RUN.sandbox_api_key = opts.sandbox_api_key or None
        signer = RUN.webhook_key is not None or RUN.pay_via == "sandbox"
        RUN.payments = signer and _payments_available(RUN.record.host, RUN.provider)
        if RUN.payments and RUN.pay_via == "sandbox" and opts.sandbox_url:
            # The sandbox duplicates every event and shuffles the copies in a window:
            # the provider's own at-least-once, out-of-order delivery.
            _admin_post(
                opts.sandbox_url,
                opts.sandbox_api_key,
                "/sandbox/config",
                {
                    "duplicates": opts.sandbox_duplicates,
                    "reorder_window_seconds": opts.sandbox_reorder_seconds,
                },
            )
        if not RUN.payments:
            _payments_off("no webhook secret or no callback endpoint")


def _payments_off(why: str) -> None:
    """The payment scenarios stop (loadtest/run then reports SKIPPED); said once."""
    RUN.payments = False
    note = f"payments unavailable ({why}): payment scenarios skipped"
    if note not in RUN.record.notes:
        RUN.record.notes.append(note)
        log.warning(note)


@events.quitting.add_listener
def _quit(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if not opts or not opts.record:
        return
    path = Path(opts.record)
    if isinstance(environment.runner, WorkerRunner):
        path = path.with_name(f"{path.stem}.{environment.runner.client_id}{path.suffix}")
    RUN.record.write(path)


# -- users ------------------------------------------------------------------------------------


def _text(resp: Any) -> str:
    """The start of an answer's body for a failure message; a request that got no
    answer at all has no text (geventhttpclient gives None)."""
    text = resp.text
    return text[:200] if text else f"no answer ({resp.error!r})"


def _hold_over(expires_at: str | None) -> bool:
    """Whether a hold that ends at `expires_at` (the gate's ISO time) has ended by
    this machine's clock (the load generator runs beside the gate)."""
    if not expires_at:
        return False
    try:
        end = datetime.fromisoformat(expires_at)
    except ValueError:
        return False
    return datetime.now(UTC) >= end


def _redeliverable(status: int) -> bool:
    """Answers a provider delivers the event again after: none at all, a timeout, a
    shed request, a server error. Any other 4xx is the sender's bug."""
    return status in (NO_ANSWER, 408, 429) or status >= 500


def _json(resp: Any) -> dict[str, Any]:
    try:
        data = orjson.loads(resp.content or b"{}")
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


class Buyer(FastHttpUser):
    abstract = True
    network_timeout = 30.0
    connection_timeout = 10.0

    def auth(self, user: int) -> dict[str, str]:
        assert RUN.mint is not None, "test_start mints tokens"
        return {"Authorization": RUN.mint.header(user)}

    def reserve(
        self,
        deal_id: int,
        user: int,
        key: str,
        name: str = "reserve",
        admission: str | None = None,
    ) -> tuple[int, str, dict[str, Any]]:
        """One reservation request; returns (status, problem code or "", body)."""
        headers = {**self.auth(user), "Idempotency-Key": key}
        if admission is not None:
            headers["Admission-Token"] = admission
        with self.client.post(
            f"/v1/deals/{deal_id}/reservations",
            json={"quantity": 1},
            headers=headers,
            name=name,
            catch_response=True,
        ) as resp:
            body = _json(resp)
            status = int(resp.status_code or NO_ANSWER)
            code = str(body.get("code", "")) if status >= 400 else ""
            if status == NO_ANSWER:
                code = "NO_ANSWER"
            RUN.record.outcome(deal_id, code or str(status))
            if status in (200, 201):
                if body.get("deal_id") != deal_id or not body.get("order_id"):
                    resp.failure(f"{status} without this deal's order: {body}")
                elif status == 200 and resp.headers.get("Idempotent-Replayed") != "true":
                    resp.failure("200 without Idempotent-Replayed: true")
                else:
                    resp.success()
                    RUN.order_seen(str(body["order_id"]), user, deal_id)
            elif status == 202:
                # Queue mode (docs/queue-mode.md): queued, committed in the background.
                if body.get("status") != "QUEUED" or body.get("deal_id") != deal_id:
                    resp.failure(f"202 without this deal's queued order: {body}")
                elif resp.headers.get("Location") != f"/v1/orders/{body.get('order_id')}":
                    resp.failure("202 without its Location")
                else:
                    resp.success()
                    RUN.order_seen(str(body["order_id"]), user, deal_id)
            elif status == 409 and code in ("SOLD_OUT", "IDEMPOTENCY_IN_PROGRESS"):
                resp.success()
            elif status in (429, 503):
                # Load shedding is an answer the crowd must expect, not an error.
                resp.success()
            elif status == NO_ANSWER:
                # No answer at all: most often a keep-alive connection the gate closed
                # as the request left on it (the request never reached the gate). A
                # browser sends it again with the same key, as after a 503.
                resp.success()
            else:
                resp.failure(f"{status} {code or _text(resp)}")
            retry_after = (resp.headers.get("Retry-After") if resp.headers else None) or "1"
        if status in (429, 503, NO_ANSWER):
            pause = min(RETRY_PAUSE_MAX_SECONDS, float(retry_after) if retry_after.isdigit() else 1)
            gevent.sleep(random.uniform(0.1, 1.0) * pause)
        return status, code, body

    def reserve_until_answered(
        self,
        deal_id: int,
        user: int,
        key: str,
        name: str = "reserve",
        admission: str | None = None,
    ) -> tuple[int, str, dict[str, Any]]:
        """A browser that retries the same key after 429/503 or no answer at all, a
        bounded number of times."""
        answer = self.reserve(deal_id, user, key, name, admission)
        for _ in range(RETRIES_MAX - 1):
            if answer[0] not in (429, 503, NO_ANSWER):
                break
            answer = self.reserve(deal_id, user, key, name + " (retry)", admission)
        return answer

    def order(self, user: int, order_id: str, name: str = "order") -> dict[str, Any] | None:
        with self.client.get(
            f"/v1/orders/{order_id}", headers=self.auth(user), name=name, catch_response=True
        ) as resp:
            body = _json(resp)
            if resp.status_code == 200 and body.get("status") in STATES:
                resp.success()
                return body
            resp.failure(f"{resp.status_code} {_text(resp)}")
            return None


class FlashSaleBuyer(Buyer):
    """A crowd of new buyers clicking once each."""

    weight = 10
    wait_time = between(0.0, 0.02)

    @task
    def click(self) -> None:
        deal_id = RUN.deal("flash")
        user = RUN.next_user()
        self.reserve_until_answered(deal_id, user, f"fs-{RUN.run_tag}-{user}")


class QueueBuyer(Buyer):
    """Queue mode: a crowd of new buyers on a deal in queue mode; each 202 is polled
    until it reads PENDING_PAYMENT, which must happen within QUEUE_SETTLE_SECONDS."""

    weight = 10
    wait_time = between(0.0, 0.02)

    @task
    def click(self) -> None:
        deal_id = RUN.deal("queue")
        user = RUN.next_user()
        status, _, body = self.reserve_until_answered(deal_id, user, f"qm-{RUN.run_tag}-{user}")
        if status != 202:
            return
        order_id = str(body["order_id"])
        deadline = time.monotonic() + QUEUE_SETTLE_SECONDS
        while True:
            with self.client.get(
                f"/v1/orders/{order_id}",
                headers=self.auth(user),
                name="order (queued)",
                catch_response=True,
            ) as resp:
                state = _json(resp).get("status") if resp.status_code == 200 else None
                if state == "PENDING_PAYMENT":
                    resp.success()
                    return
                if state == "QUEUED" or resp.status_code == 503:
                    resp.success()
                else:
                    resp.failure(f"queued order {order_id}: {resp.status_code} {_text(resp)}")
                    return
            if time.monotonic() >= deadline:
                RUN.record.outcome(deal_id, "QUEUED_TOO_LONG")
                return
            gevent.sleep(0.2)


class DuplicateClicker(Buyer):
    """Double/triple clicks with one key, concurrently, then a browser retry."""

    weight = 3
    wait_time = between(0.0, 0.05)
    concurrency = 4

    @task
    def clicks(self) -> None:
        deal_id = RUN.deal("flash")
        user = RUN.next_user()
        key = f"dup-{RUN.run_tag}-{user}"
        answers: list[tuple[int, str, dict[str, Any]]] = []
        group = Group()
        for _ in range(random.randint(2, 4)):
            group.spawn(lambda: answers.append(self.reserve(deal_id, user, key, "reserve (click)")))
        group.join()
        gevent.sleep(random.uniform(0.0, 0.1))
        answers.append(self.reserve_until_answered(deal_id, user, key, "reserve (again)"))
        created = [a for a in answers if a[0] == 201]
        orders = {str(a[2]["order_id"]) for a in answers if a[0] in (200, 201)}
        if len(created) > 1 or len(orders) > 1:
            RUN.record.violation(
                f"key {key} (user {user}): {len(created)} answers 201, order ids {sorted(orders)}"
            )


class Reader(Buyer):
    """Buyers who hold one order and keep polling it and the deal."""

    weight = 2
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.user = RUN.next_user()
        self.order_id: str | None = None
        deal_id = RUN.deal("reader")
        key = f"rd-{RUN.run_tag}-{self.user}"
        status, _, body = self.reserve_until_answered(deal_id, self.user, key)
        if status in (200, 201):
            self.order_id = str(body["order_id"])

    @task(3)
    def poll_deal(self) -> None:
        deal_id = RUN.deal("reader")
        with self.client.get(f"/v1/deals/{deal_id}", name="deal", catch_response=True) as resp:
            body = _json(resp)
            if resp.status_code == 200 and body.get("id") == deal_id and "sold_out" in body:
                resp.success()
            else:
                resp.failure(f"{resp.status_code} {_text(resp)}")

    @task(2)
    def poll_order(self) -> None:
        if self.order_id is None:
            return
        body = self.order(self.user, self.order_id)
        if body is not None and body.get("order_id", body.get("id")) != self.order_id:
            RUN.record.violation(f"order {self.order_id}: read back as {body}")

    @task(1)
    def peek(self) -> None:
        """Another buyer's order must look exactly like one that does not exist."""
        if not RUN.record.created:
            return
        order_id, owner, _ = random.choice(RUN.record.created)
        if owner == self.user:
            return
        with self.client.get(
            f"/v1/orders/{order_id}",
            headers=self.auth(self.user),
            name="order (someone else's)",
            catch_response=True,
        ) as resp:
            if resp.status_code == 404:
                resp.success()
            else:
                resp.failure(f"another buyer's order answered {resp.status_code}")
                RUN.record.violation(f"user {self.user} could read order {order_id}")


class Payer(Buyer):
    abstract = True
    concurrency = 4

    def on_start(self) -> None:
        if not RUN.payments:
            raise StopUser()

    def session(
        self, user: int, order_id: str, expires_at: str | None = None
    ) -> dict[str, Any] | None:
        """Open the payment session twice: the second answer must be the same session.
        Given the hold's end (`expires_at`, the late payers' holds last 2 s), a 409
        once it has passed is the gate's right answer (a slow moment of the machine
        can put the end between the two requests): the buyer pays on the session it
        has, if any."""
        sessions: list[dict[str, Any]] = []
        for name in ("payment session", "payment session (again)"):
            with self.client.post(
                f"/v1/orders/{order_id}/payment",
                headers=self.auth(user),
                name=name,
                catch_response=True,
            ) as resp:
                body = _json(resp)
                if resp.status_code in (200, 201) and body.get("session_id"):
                    resp.success()
                    sessions.append(body)
                elif resp.status_code == 503 and NO_PROVIDER in str(body.get("detail")):
                    # A gate without a provider: the payment scenarios cannot run there.
                    resp.success()
                    _payments_off("the gate has no payment provider configured")
                    raise StopUser()
                elif resp.status_code == 409 and _hold_over(expires_at):
                    resp.success()
                    return sessions[0] if sessions else None
                else:
                    resp.failure(f"{resp.status_code} {_text(resp)}")
                    return None
        if sessions[0]["session_id"] != sessions[1]["session_id"]:
            RUN.record.violation(f"order {order_id}: two payment sessions {sessions}")
        return sessions[0]

    def deliver(
        self, delivery: webhooks.Delivery, name: str, order_id: str, deal_id: int, last: bool
    ) -> int:
        """One HTTP delivery; returns its status (NO_ANSWER when none came back) and
        records it. An answer worth a redelivery is a locust failure only when no
        redelivery follows (`last`)."""
        with self.client.post(
            f"/v1/payments/{RUN.provider}/webhook",
            data=delivery.body,
            headers=delivery.headers,
            name=name,
            catch_response=True,
        ) as resp:
            status = int(resp.status_code or NO_ANSWER)
            if acknowledged(status) or (_redeliverable(status) and not last):
                resp.success()
            else:
                resp.failure(f"{status} {_text(resp)}")
        event_type = str(orjson.loads(delivery.body).get("type", ""))
        RUN.record.delivery((order_id, deal_id, delivery.event_id, event_type, status))
        return status

    def pay_in_sandbox(self, session: dict[str, Any], reorder: bool) -> bool:
        """Pay on the sandbox's pay step; with `reorder`, a failed attempt first (its
        payment.failed and the success then reach the gate in any order). True when
        the sandbox took the successful payment (2xx): it delivers the callbacks."""
        outcomes = ["fail", "succeed"] if reorder else ["succeed"]
        taken = False
        for outcome in outcomes:
            with self.client.post(
                str(session["redirect_url"]),
                json={"outcome": outcome},
                # The pay step moves money: a keyed sandbox wants its key there too.
                headers={"Authorization": f"Bearer {RUN.sandbox_api_key}"}
                if RUN.sandbox_api_key
                else {},
                name=f"sandbox pay ({outcome})",
                catch_response=True,
            ) as resp:
                if 200 <= resp.status_code < 300:
                    resp.success()
                    taken = outcome == "succeed"
                else:
                    resp.failure(f"{resp.status_code} {_text(resp)}")
        return taken

    def pay(
        self,
        order: dict[str, Any],
        session: dict[str, Any],
        duplicates: int,
        reorder: bool,
        deal_id: int,
    ) -> bool:
        """Deliver payment.succeeded `duplicates` times (concurrently) and, when
        `reorder`, an earlier failed attempt's event, in a shuffled order; then once
        more each event no copy of which got a 2xx, in rounds. True when the
        payment.succeeded got a 2xx: the gate took the payment."""
        if RUN.pay_via == "sandbox":
            return self.pay_in_sandbox(session, reorder)
        assert RUN.webhook_key is not None
        key = RUN.webhook_key
        order_id = str(order["order_id"])
        amount, currency = int(order["amount"]), str(order["currency"])
        succeeded = webhooks.event(
            "payment.succeeded", order_id, f"pay_{order_id}_2", amount, currency
        )
        # event payload, webhook-id, copies at once, locust name
        events_out = [(succeeded, "msg_" + secrets.token_hex(12), duplicates, "webhook succeeded")]
        if reorder:
            failed = webhooks.event(
                "payment.failed", order_id, f"pay_{order_id}_1", amount, currency
            )
            events_out.append((failed, "msg_" + secrets.token_hex(12), 1, "webhook failed (stale)"))
        taken: set[str] = set()  # event ids answered for good (2xx or a final 4xx)
        acked: set[str] = set()  # event ids a copy of which got a 2xx
        for attempt in range(DELIVERY_ATTEMPTS_MAX):
            last = attempt == DELIVERY_ATTEMPTS_MAX - 1
            if attempt:
                gevent.sleep(REDELIVERY_PAUSE_SECONDS * attempt)
            deliveries = []
            for payload, msg_id, copies, name in events_out:
                if str(payload["id"]) in taken:
                    continue
                for copy in range(copies if attempt == 0 else 1):
                    if attempt:
                        label = "webhook redelivery"
                    else:
                        label = "webhook duplicate" if copy else name
                    deliveries.append((webhooks.sign(key, payload, msg_id=msg_id), label))
            if not deliveries:
                break
            random.shuffle(deliveries)
            group = Group()
            sent = [
                (d.event_id, group.spawn(self.deliver, d, n, order_id, deal_id, last))
                for d, n in deliveries
            ]
            group.join()
            for event_id, greenlet in sent:
                # A delivery that raised (a bug here) counts as no answer.
                status = int(greenlet.value) if greenlet.successful() else NO_ANSWER
                if acknowledged(status):
                    acked.add(event_id)
                if acknowledged(status) or not _redeliverable(status):
                    # Taken, or refused for good (a 4xx other than 408/429: no
                    # redelivery changes that).
                    taken.add(event_id)
        return str(succeeded["id"]) in acked

    def wait_status(self, user: int, order_id: str, wanted: tuple[str, ...], seconds: float) -> str:
        deadline = time.monotonic() + seconds
        status = "?"
        while time.monotonic() < deadline:
            body = self.order(user, order_id, "order (after payment)")
            status = str(body.get("status")) if body else "?"
            if status in wanted:
                break
            gevent.sleep(0.5)
        return status


class PayingBuyer(Payer):
    """Reserve, pay in time; callbacks duplicated and reordered; the order ends PAID."""

    weight = 2
    wait_time = between(0.1, 0.5)

    @task
    def buy(self) -> None:
        deal_id = RUN.deal("pay")
        user = RUN.next_user()
        status, _, order = self.reserve_until_answered(deal_id, user, f"pay-{RUN.run_tag}-{user}")
        if status not in (200, 201):
            return
        session = self.session(user, str(order["order_id"]))
        if session is None:
            return
        paid = self.pay(order, session, random.randint(1, 3), random.random() < 0.5, deal_id)
        ref: OrderRef = (str(order["order_id"]), user, deal_id)
        if not paid:
            # The gate never said it took the payment: not one to expect PAID.
            RUN.record.add(RUN.record.unpaid, ref)
            return
        RUN.record.add(RUN.record.paid, ref)
        if self.wait_status(user, ref[0], ("PAID",), PAID_WAIT_SECONDS) != "PAID":
            log.warning("order %s not PAID after %s s", ref[0], PAID_WAIT_SECONDS)


class LatePayer(Payer):
    """Short holds that expire while the buyer is still paying."""

    weight = 1
    wait_time = between(0.1, 0.5)

    @task
    def buy_late(self) -> None:
        deal_id = RUN.deal("late")
        user = RUN.next_user()
        status, _, order = self.reserve_until_answered(deal_id, user, f"late-{RUN.run_tag}-{user}")
        if status not in (200, 201):
            return
        session = self.session(user, str(order["order_id"]), str(order.get("expires_at") or ""))
        if session is None:
            return
        hold = int(RUN.options.late_hold_seconds) if RUN.options else 2
        # Past the deadline, and usually past the sweeper's release too (≤ 2 s).
        gevent.sleep(hold + random.uniform(0.5, 3.5))
        paid = self.pay(order, session, random.randint(1, 2), False, deal_id)
        ref: OrderRef = (str(order["order_id"]), user, deal_id)
        if not paid:
            RUN.record.add(RUN.record.unpaid, ref)
            return
        RUN.record.add(RUN.record.late_paid, ref)
        self.wait_status(user, ref[0], LATE_ENDS, LATE_END_WAIT_SECONDS)


ROOM_POLLS_MAX = 200
# Rooms that answered NO_CHALLENGE: their buyers join without asking again.
ROOMS_WITHOUT_CHALLENGE: set[int] = set()
ROOM_SOLD_OUT_POLLS_MAX = 3


class WaitingRoomBuyer(Buyer):
    """Join the waiting room, poll as advised, reserve when admitted (or abandon)."""

    weight = 10
    wait_time = between(0.0, 0.05)

    def join_body(self, deal_id: int, user: int) -> dict[str, str] | None:
        """A solved challenge when the room asks one (GET .../queue/challenge; a 409
        NO_CHALLENGE is remembered per deal), else None."""
        if deal_id in ROOMS_WITHOUT_CHALLENGE:
            return None
        with self.client.get(
            f"/v1/deals/{deal_id}/queue/challenge",
            headers=self.auth(user),
            name="queue challenge",
            catch_response=True,
        ) as resp:
            body = _json(resp)
            if resp.status_code == 409 and body.get("code") == "NO_CHALLENGE":
                resp.success()
                ROOMS_WITHOUT_CHALLENGE.add(deal_id)
                return None
            if resp.status_code != 200:
                resp.failure(f"{resp.status_code} {resp.text[:200]}")
                return None
            resp.success()
        challenge, bits = str(body["challenge"]), int(body["bits"])
        RUN.record.outcome(deal_id, f"challenge:{bits}_bits")
        return {"challenge": challenge, "nonce": solve(challenge, bits)}

    def ticket(self, deal_id: int, user: int, join: bool) -> dict[str, Any] | None:
        method = self.client.post if join else self.client.get
        extra: dict[str, Any] = {}
        if join:
            body = self.join_body(deal_id, user)
            if body is not None:
                extra["json"] = body
        with method(
            f"/v1/deals/{deal_id}/queue",
            headers=self.auth(user),
            name="queue join" if join else "queue poll",
            catch_response=True,
            **extra,
        ) as resp:
            body = _json(resp)
            if resp.status_code in (200, 201) and body.get("state"):
                resp.success()
                RUN.record.outcome(deal_id, f"ticket:{body['state']}")
                return body
            code = str(body.get("code", resp.status_code))
            RUN.record.outcome(deal_id, f"ticket:{code}")
            if resp.status_code in (429, 503):
                resp.success()  # shed or too soon: the next poll comes after a pause
            else:
                resp.failure(f"{resp.status_code} {resp.text[:200]}")
            return None

    @task
    def queue_and_buy(self) -> None:
        deal_id = RUN.deal("room")
        user = RUN.next_user()
        ticket = self.ticket(deal_id, user, join=True)
        last_position: int | None = None
        sold_out_polls = 0
        for _ in range(ROOM_POLLS_MAX):
            if ticket is not None:
                state = ticket["state"]
                position = ticket.get("position")
                if state in ("waiting", "unlikely") and position is not None:
                    if last_position is not None and position > last_position:
                        RUN.record.violation(
                            f"room {deal_id}: user {user} moved back from {last_position}"
                            f" to {position}"
                        )
                    last_position = position
                if state == "admitted":
                    self.admitted(deal_id, user, ticket)
                    return
                if state == "closed":
                    return
                sold_out_polls = sold_out_polls + 1 if state == "sold_out" else 0
                if sold_out_polls > ROOM_SOLD_OUT_POLLS_MAX:
                    return  # the buyer gives up
                pause = int(ticket.get("poll_after_ms") or 1000) / 1000
            else:
                pause = 1.0
            gevent.sleep(pause * random.uniform(1.0, 1.2))
            ticket = self.ticket(deal_id, user, join=False)

    def admitted(self, deal_id: int, user: int, ticket: dict[str, Any]) -> None:
        token = ticket.get("admission_token")
        if not token:
            RUN.record.violation(f"room {deal_id}: user {user} admitted without a token")
            return
        opts = RUN.options
        if random.random() < (opts.room_abandon if opts else 0.2):
            RUN.record.outcome(deal_id, "room:abandoned")
            return
        _, code, _ = self.reserve_until_answered(
            deal_id, user, f"room-{RUN.run_tag}-{user}", "reserve (admitted)", str(token)
        )
        if code in ("ADMISSION_REQUIRED", "ADMISSION_INVALID"):
            RUN.record.violation(f"room {deal_id}: user {user}'s fresh admission refused: {code}")
