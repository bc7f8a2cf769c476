"""A local fake of WeChat Pay API v3, for tests only (never in the image).

Follows WeChat Pay's published v3 documentation (pay.weixin.qq.com/doc/v3) for what
the gate uses:
- every request's `Authorization: WECHATPAY2-SHA256-RSA2048 mchid=…,nonce_str=…,
  signature=…,timestamp=…,serial_no=…` verified with the merchant's public key over
  "METHOD\\nPATH?QUERY\\ntimestamp\\nnonce\\nbody\\n", timestamp within ±300 s, the
  serial matching: else 401 `SIGN_ERROR`;
- every answer signed with the platform key: Wechatpay-Timestamp, -Nonce,
  -Signature, -Serial over "timestamp\\nnonce\\nbody\\n";
- errors as `{"code": …, "message": …}`: 400 PARAM_ERROR / INVALID_REQUEST /
  ORDERPAID, 404 ORDER_NOT_EXIST / RESOURCE_NOT_EXISTS, 403 NOT_ENOUGH (refund over
  the refundable amount), 500 SYSTEM_ERROR (switchable);
- POST /v3/pay/transactions/native (idempotent by out_trade_no for the same
  parameters), GET …/out-trade-no/{no}?mchid=, GET …/id/{transaction_id}?mchid=,
  POST …/out-trade-no/{no}/close (204), POST /v3/refund/domestic/refunds
  (idempotent by out_refund_no; PROCESSING, then SUCCESS), GET
  /v3/refund/domestic/refunds/{out_refund_no};
- notifications: JSON with the resource encrypted AEAD_AES_256_GCM with the APIv3
  key, signed like answers, retried until a 200/204 (WeChat: 15 times over 24 h
  4 m, 15s/15s/30s/3m/10m/…; here FAKE_NOTIFY_SCHEDULE seconds), fresh timestamp and
  signature per attempt, the same id. TRANSACTION.SUCCESS only for payments (no
  notification for a failed or closed one); REFUND.SUCCESS / REFUND.ABNORMAL.

Test controls under /_fake/: pay, configure (drop notifications, fail calls with
500, refund outcome, which platform key signs: a rotation), notifications,
redeliver, trades (an order, its refunded total and refunds).
"""

from __future__ import annotations

import os
import random
import secrets
import time
import uuid
from datetime import datetime
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gate.payments.providers.rsa_http import (
    read_private_key,
    read_public_key,
    sign_sha256_rsa,
    verify_sha256_rsa,
)
from gate.payments.providers.wechatpay import (
    CST,
    answer_message,
    encrypt_resource,
    parse_authorization,
    request_message,
)
from tests.fake_support import Deliveries, Delivery, control_app, serve

MCHID = os.environ.get("FAKE_WECHATPAY_MCHID", "1900000001")
APPID = os.environ.get("FAKE_WECHATPAY_APPID", "wxd678efh567hg6787")
APIV3_KEY = os.environ.get("FAKE_WECHATPAY_APIV3_KEY", "")
MERCHANT_SERIAL = os.environ.get("FAKE_WECHATPAY_MERCHANT_SERIAL", "")
PLATFORM_SERIAL = os.environ.get(
    "FAKE_WECHATPAY_PLATFORM_SERIAL", "5157F09EFDC096DE15EBE81A47057A72"
)
MERCHANT_PUBLIC_KEY = read_public_key(
    "FAKE_WECHATPAY_MERCHANT_PUBLIC_KEY_FILE",
    os.environ.get("FAKE_WECHATPAY_MERCHANT_PUBLIC_KEY_FILE", ""),
)
PLATFORM_KEY = read_private_key(
    "FAKE_WECHATPAY_PLATFORM_PRIVATE_KEY_FILE",
    os.environ.get("FAKE_WECHATPAY_PLATFORM_PRIVATE_KEY_FILE", ""),
)
# A second platform key, for rotations: /_fake/configure {"platform_key": "b"} signs
# everything from then on with it and names its serial (WeChat's public-key mode id
# by default) in Wechatpay-Serial; {"platform_key": "a"} goes back.
PLATFORM_B_SERIAL = os.environ.get(
    "FAKE_WECHATPAY_PLATFORM_B_SERIAL", "PUB_KEY_ID_0114232134912410000000000000"
)
PLATFORM_B_KEY_FILE = os.environ.get("FAKE_WECHATPAY_PLATFORM_B_PRIVATE_KEY_FILE", "")
PLATFORM_KEYS = {"a": (PLATFORM_SERIAL, PLATFORM_KEY)}
if PLATFORM_B_KEY_FILE:
    PLATFORM_KEYS["b"] = (
        PLATFORM_B_SERIAL,
        read_private_key("FAKE_WECHATPAY_PLATFORM_B_PRIVATE_KEY_FILE", PLATFORM_B_KEY_FILE),
    )
SCHEDULE = [float(s) for s in os.environ.get("FAKE_NOTIFY_SCHEDULE", "0.3,0.6,1.2").split(",")]
TOLERANCE_SECONDS = 300


def _now() -> str:
    return datetime.now(CST).isoformat(timespec="seconds")


class State:
    def __init__(self) -> None:
        self.orders: dict[str, dict[str, Any]] = {}  # out_trade_no -> order
        self.refunds: dict[str, dict[str, Any]] = {}  # out_refund_no -> refund
        self.failing = 0
        self.refund_outcome = "SUCCESS"
        self.platform = "a"
        self.notes = Deliveries(SCHEDULE, lambda status, body: status in (200, 204))
        self.seq = random.randrange(10**8)


STATE = State()


def _signed_headers(body: bytes) -> dict[str, str]:
    ts = str(int(time.time()))
    nonce = secrets.token_hex(16)
    serial, key = PLATFORM_KEYS[STATE.platform]
    return {
        "Wechatpay-Timestamp": ts,
        "Wechatpay-Nonce": nonce,
        "Wechatpay-Signature": sign_sha256_rsa(key, answer_message(ts, nonce, body)),
        "Wechatpay-Serial": serial,
        "Request-ID": str(uuid.uuid4()),
    }


def _answer(doc: dict[str, Any] | None, status: int = 200) -> Response:
    body = orjson.dumps(doc) if doc is not None else b""
    return Response(
        body,
        status_code=status,
        headers=_signed_headers(body),
        media_type="application/json" if doc is not None else None,
    )


def _error(status: int, code: str, message: str) -> Response:
    return _answer({"code": code, "message": message}, status)


def _notify(url: str | None, event_type: str, original_type: str, resource: dict[str, Any]) -> None:
    if not url:
        return
    event_id = str(uuid.uuid4())
    created = _now()
    nonce = secrets.token_hex(6)  # 12 bytes: GCM's standard nonce, as WeChat's are
    plain = orjson.dumps(resource)

    def build() -> tuple[bytes, dict[str, str]]:
        body = orjson.dumps(
            {
                "id": event_id,
                "create_time": created,
                "resource_type": "encrypt-resource",
                "event_type": event_type,
                "summary": "支付成功" if event_type == "TRANSACTION.SUCCESS" else "退款状态",
                "resource": {
                    "original_type": original_type,
                    "algorithm": "AEAD_AES_256_GCM",
                    "ciphertext": encrypt_resource(APIV3_KEY, plain, nonce, original_type),
                    "associated_data": original_type,
                    "nonce": nonce,
                },
            }
        )
        return body, {"Content-Type": "application/json", **_signed_headers(body)}

    STATE.notes.notify(
        Delivery(
            id=event_id,
            url=url,
            kind=event_type,
            subject=str(resource.get("out_trade_no")),
            build=build,
        )
    )


async def _authenticate(request: Request, body: bytes) -> Response | None:
    try:
        fields = parse_authorization(request.headers.get("authorization", ""))
    except ValueError:
        return _error(401, "SIGN_ERROR", "Authorization header missing or malformed")
    if fields.get("mchid") != MCHID:
        return _error(401, "SIGN_ERROR", "mchid does not match")
    if fields.get("serial_no") != MERCHANT_SERIAL:
        return _error(401, "SIGN_ERROR", "serial_no is not the merchant certificate's")
    ts = fields.get("timestamp", "")
    if not ts.isdigit() or abs(time.time() - int(ts)) > TOLERANCE_SECONDS:
        return _error(401, "SIGN_ERROR", "timestamp expired")
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    message = request_message(request.method, path, ts, fields.get("nonce_str", ""), body)
    if not verify_sha256_rsa(MERCHANT_PUBLIC_KEY, message, fields.get("signature", "")):
        return _error(401, "SIGN_ERROR", "signature does not verify")
    if STATE.failing > 0:
        STATE.failing -= 1
        return _error(500, "SYSTEM_ERROR", "system busy, retry")
    return None


def _transaction(order: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "appid": APPID,
        "mchid": MCHID,
        "out_trade_no": order["out_trade_no"],
        "trade_type": "NATIVE",
        "trade_state": order["trade_state"],
        "trade_state_desc": order["trade_state"],
        "amount": {"total": order["total"], "currency": "CNY"},
        "attach": "",
    }
    if order.get("transaction_id"):
        doc["transaction_id"] = order["transaction_id"]
        doc["bank_type"] = "OTHERS"
        doc["payer"] = {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}
        doc["amount"].update({"payer_total": order["total"], "payer_currency": "CNY"})
    if order.get("success_time"):
        doc["success_time"] = order["success_time"]
    return doc


async def native(request: Request) -> Response:
    body = await request.body()
    refused = await _authenticate(request, body)
    if refused is not None:
        return refused
    try:
        doc = orjson.loads(body)
        amount = doc["amount"]
        total = amount["total"]
        out_trade_no = doc["out_trade_no"]
        if (
            doc["appid"] != APPID
            or doc["mchid"] != MCHID
            or not isinstance(total, int)
            or isinstance(total, bool)
            or total <= 0
            or amount.get("currency", "CNY") != "CNY"
            or not isinstance(out_trade_no, str)
            or not 6 <= len(out_trade_no) <= 32
            or not doc["description"]
            or not str(doc["notify_url"]).startswith(("http://", "https://"))
        ):
            raise ValueError
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return _error(400, "PARAM_ERROR", "parameter error")
    order = STATE.orders.get(out_trade_no)
    if order is not None:
        if order["trade_state"] in ("SUCCESS", "REFUND"):
            return _error(400, "ORDERPAID", "order already paid")
        if order["trade_state"] == "CLOSED":
            return _error(400, "ORDER_CLOSED", "order closed")
        if order["total"] != total or order["description"] != doc["description"]:
            return _error(400, "INVALID_REQUEST", "out_trade_no used with other parameters")
    else:
        order = {
            "out_trade_no": out_trade_no,
            "total": total,
            "description": doc["description"],
            "notify_url": doc["notify_url"],
            "time_expire": doc.get("time_expire"),
            "trade_state": "NOTPAY",
            "code_url": f"weixin://wxpay/bizpayurl?pr={secrets.token_urlsafe(6)}",
            "refunded": 0,
        }
        STATE.orders[out_trade_no] = order
    return _answer({"code_url": order["code_url"]})


async def query_by_order(request: Request) -> Response:
    refused = await _authenticate(request, b"")
    if refused is not None:
        return refused
    if request.query_params.get("mchid") != MCHID:
        return _error(400, "PARAM_ERROR", "mchid is required")
    order = STATE.orders.get(request.path_params["no"])
    if order is None:
        return _error(404, "ORDER_NOT_EXIST", "order does not exist")
    return _answer(_transaction(order))


async def query_by_id(request: Request) -> Response:
    refused = await _authenticate(request, b"")
    if refused is not None:
        return refused
    tx = request.path_params["id"]
    order = next((o for o in STATE.orders.values() if o.get("transaction_id") == tx), None)
    if order is None:
        return _error(404, "ORDER_NOT_EXIST", "order does not exist")
    return _answer(_transaction(order))


async def close_order(request: Request) -> Response:
    body = await request.body()
    refused = await _authenticate(request, body)
    if refused is not None:
        return refused
    order = STATE.orders.get(request.path_params["no"])
    if order is None:
        return _error(404, "ORDER_NOT_EXIST", "order does not exist")
    if order["trade_state"] in ("SUCCESS", "REFUND"):
        return _error(400, "ORDERPAID", "order already paid")
    order["trade_state"] = "CLOSED"
    return _answer(None, 204)


def _refund_doc(refund: dict[str, Any]) -> dict[str, Any]:
    return {
        "refund_id": refund["refund_id"],
        "out_refund_no": refund["out_refund_no"],
        "transaction_id": refund["transaction_id"],
        "out_trade_no": refund["out_trade_no"],
        "channel": "ORIGINAL",
        "user_received_account": "支付用户零钱",
        "status": refund["status"],
        "create_time": refund["create_time"],
        **({"success_time": refund["success_time"]} if refund.get("success_time") else {}),
        "amount": {
            "total": refund["total"],
            "refund": refund["refund"],
            "payer_total": refund["total"],
            "payer_refund": refund["refund"],
            "currency": "CNY",
        },
    }


async def create_refund(request: Request) -> Response:
    body = await request.body()
    refused = await _authenticate(request, body)
    if refused is not None:
        return refused
    try:
        doc = orjson.loads(body)
        out_refund_no = doc["out_refund_no"]
        amount = doc["amount"]
        refund_fen, total = amount["refund"], amount["total"]
        if not isinstance(out_refund_no, str) or not 1 <= len(out_refund_no) <= 64:
            raise ValueError
        if not isinstance(refund_fen, int) or not isinstance(total, int) or refund_fen <= 0:
            raise ValueError
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return _error(400, "PARAM_ERROR", "parameter error")
    existing = STATE.refunds.get(out_refund_no)
    if existing is not None:
        if existing["refund"] != refund_fen:
            return _error(400, "INVALID_REQUEST", "out_refund_no used with another amount")
        return _answer(_refund_doc(existing))
    if doc.get("transaction_id"):
        order = next(
            (o for o in STATE.orders.values() if o.get("transaction_id") == doc["transaction_id"]),
            None,
        )
    else:
        order = STATE.orders.get(str(doc.get("out_trade_no")))
    if order is None or order["trade_state"] not in ("SUCCESS", "REFUND"):
        return _error(404, "RESOURCE_NOT_EXISTS", "order does not exist or is not paid")
    if order["refunded"] + refund_fen > order["total"]:
        return _error(403, "NOT_ENOUGH", "refund amount exceeds the refundable amount")
    STATE.seq += 1
    refund = {
        "refund_id": f"50300{STATE.seq:022d}",
        "out_refund_no": out_refund_no,
        "transaction_id": order["transaction_id"],
        "out_trade_no": order["out_trade_no"],
        "status": "PROCESSING",
        "create_time": _now(),
        "total": order["total"],
        "refund": refund_fen,
        "notify_url": doc.get("notify_url") or order["notify_url"],
    }
    STATE.refunds[out_refund_no] = refund
    answer = _refund_doc(refund)
    # The refund settles after the answer (WeChat: usually within seconds).
    if STATE.refund_outcome == "SUCCESS":
        refund["status"] = "SUCCESS"
        refund["success_time"] = _now()
        order["refunded"] += refund_fen
        order["trade_state"] = "REFUND"
        event = "REFUND.SUCCESS"
    else:
        refund["status"] = "ABNORMAL"
        event = "REFUND.ABNORMAL"
    _notify(
        refund["notify_url"],
        event,
        "refund",
        {
            "mchid": MCHID,
            "out_trade_no": refund["out_trade_no"],
            "transaction_id": refund["transaction_id"],
            "out_refund_no": out_refund_no,
            "refund_id": refund["refund_id"],
            "refund_status": refund["status"],
            **({"success_time": refund["success_time"]} if refund.get("success_time") else {}),
            "user_received_account": "支付用户零钱",
            "amount": {
                "total": refund["total"],
                "refund": refund_fen,
                "payer_total": refund["total"],
                "payer_refund": refund_fen,
            },
        },
    )
    return _answer(answer)


async def get_refund(request: Request) -> Response:
    refused = await _authenticate(request, b"")
    if refused is not None:
        return refused
    refund = STATE.refunds.get(request.path_params["no"])
    if refund is None:
        return _error(404, "RESOURCE_NOT_EXISTS", "refund does not exist")
    return _answer(_refund_doc(refund))


# -- test controls ----------------------------------------------------------------------


async def pay(request: Request) -> Response:
    """The buyer scans and pays (succeed) or the payment fails (fail: PAYERROR, no
    notification, as WeChat sends none). A payment after time_expire is taken on
    purpose: the late payment the gate must handle."""
    doc = orjson.loads(await request.body())
    order = STATE.orders.get(doc.get("out_trade_no", ""))
    if order is None:
        return JSONResponse({"error": "no such order"}, 404)
    if order["trade_state"] not in ("NOTPAY", "USERPAYING"):
        return JSONResponse({"error": f"order is {order['trade_state']}"}, 409)
    STATE.seq += 1
    # `transaction_id`: a test's own id (one WeChat would never issue, say).
    order["transaction_id"] = str(doc.get("transaction_id") or f"42000{STATE.seq:023d}")
    if doc.get("outcome", "succeed") == "succeed":
        order["trade_state"] = "SUCCESS"
        order["success_time"] = _now()
        _notify(order["notify_url"], "TRANSACTION.SUCCESS", "transaction", _transaction(order))
    else:
        order["trade_state"] = "PAYERROR"
    return JSONResponse(_transaction(order))


async def configure(request: Request) -> Response:
    doc = orjson.loads(await request.body())
    STATE.notes.configure(doc)
    STATE.failing = int(doc.get("failing_calls", STATE.failing))
    STATE.refund_outcome = str(doc.get("refund_outcome", STATE.refund_outcome))
    platform = str(doc.get("platform_key", STATE.platform))
    if platform not in PLATFORM_KEYS:
        return JSONResponse({"error": f"no platform key {platform!r}"}, 400)
    STATE.platform = platform
    return JSONResponse({"drop": STATE.notes.drop, "failing": STATE.failing})


async def trades(request: Request) -> Response:
    """An order as the fake holds it, with its refunded total and its refunds."""
    no = request.path_params["out_trade_no"]
    order = STATE.orders.get(no)
    if order is None:
        return JSONResponse({"error": "no such order"}, 404)
    refunds = [r["out_refund_no"] for r in STATE.refunds.values() if r["out_trade_no"] == no]
    return JSONResponse({**order, "refunded_fen": order["refunded"], "refunds": refunds})


app = control_app(
    [
        Route("/v3/pay/transactions/native", native, methods=["POST"]),
        Route("/v3/pay/transactions/out-trade-no/{no}", query_by_order),
        Route("/v3/pay/transactions/out-trade-no/{no}/close", close_order, methods=["POST"]),
        Route("/v3/pay/transactions/id/{id}", query_by_id),
        Route("/v3/refund/domestic/refunds", create_refund, methods=["POST"]),
        Route("/v3/refund/domestic/refunds/{no}", get_refund),
        Route("/_fake/pay", pay, methods=["POST"]),
        Route("/_fake/configure", configure, methods=["POST"]),
        Route("/_fake/trades/{out_trade_no}", trades),
    ],
    STATE.notes,
)

if __name__ == "__main__":
    serve(app, "a local fake of WeChat Pay API v3 (tests only)")
