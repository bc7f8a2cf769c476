"""A local fake of Alipay's open API gateway, for tests only (never in the image).

Follows Alipay's published documentation (opendocs.alipay.com) for what the gate
uses:
- one gateway URL, form POST, common parameters app_id/method/format/charset/
  sign_type/timestamp/version/biz_content(/notify_url), RSA2 over the sorted
  parameters without sign and sign_type, verified with the app's public key
  (else `40002 isv.invalid-signature`), app_id checked (`isv.invalid-app-id`);
- answers `{"<method>_response": {...}, "sign": "..."}` signed with Alipay's key
  over the exact response text; `code` 10000 success, 40004 business failure with
  `sub_code` (ACQ.TRADE_NOT_EXIST, ACQ.TRADE_HAS_SUCCESS, ACQ.CONTEXT_INCONSISTENT,
  ACQ.TRADE_STATUS_ERROR, ACQ.REFUND_AMT_NOT_EQUAL_TOTAL), 40002 invalid
  parameters, 20000 service unavailable (switchable);
- alipay.trade.precreate (idempotent by out_trade_no; the trade is only queryable
  once the buyer scanned: ACQ.TRADE_NOT_EXIST before), alipay.trade.query,
  alipay.trade.refund (idempotent by out_request_no: a repeat answers
  fund_change "N"), alipay.trade.fastpay.refund.query (refund_status
  REFUND_SUCCESS, absent when there is no such refund), alipay.trade.close;
- asynchronous notifications (trade_status_sync) form-encoded and RSA2-signed,
  retried until the answer body is exactly `success` (Alipay: 8 times over 25 h,
  4m 10m 10m 1h 2h 6h 15h; here FAKE_NOTIFY_SCHEDULE seconds), notify_time per
  attempt, the same notify_id across retries; refunds notified with out_biz_no,
  refund_fee (the trade's refunded total) and gmt_refund, trade_status
  TRADE_CLOSED once all is refunded.

Test controls under /_fake/: pay (the buyer scans and pays, or fails), configure
(drop the next N notifications, answer 20000 to the next N calls), notifications,
redeliver, trades.
"""

from __future__ import annotations

import os
import random
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gate.payments.providers.alipay import CST, TIME_FORMAT, signing_string
from gate.payments.providers.rsa_http import (
    fen_to_yuan,
    read_private_key,
    read_public_key,
    sign_sha256_rsa,
    verify_sha256_rsa,
    yuan_to_fen,
)
from tests.fake_support import Deliveries, Delivery, control_app, serve

APP_ID = os.environ.get("FAKE_ALIPAY_APP_ID", "2021000000000001")
APP_PUBLIC_KEY = read_public_key(
    "FAKE_ALIPAY_APP_PUBLIC_KEY_FILE", os.environ.get("FAKE_ALIPAY_APP_PUBLIC_KEY_FILE", "")
)
ALIPAY_KEY = read_private_key(
    "FAKE_ALIPAY_PRIVATE_KEY_FILE", os.environ.get("FAKE_ALIPAY_PRIVATE_KEY_FILE", "")
)
SCHEDULE = [float(s) for s in os.environ.get("FAKE_NOTIFY_SCHEDULE", "0.3,0.6,1.2").split(",")]


def _now() -> str:
    return datetime.now(CST).strftime(TIME_FORMAT)


class State:
    def __init__(self) -> None:
        self.trades: dict[str, dict[str, Any]] = {}  # out_trade_no -> trade
        self.unavailable = 0
        self.notes = Deliveries(SCHEDULE, lambda status, body: status == 200 and body == b"success")
        self.trade_seq = random.randrange(10**8)


STATE = State()


def _answer(method: str, value: dict[str, Any]) -> Response:
    name = method.replace(".", "_") + "_response" if method else "error_response"
    content = orjson.dumps(value)
    sign = sign_sha256_rsa(ALIPAY_KEY, content)
    text = b'{"' + name.encode() + b'":' + content + b',"sign":"' + sign.encode() + b'"}'
    return Response(text, media_type="application/json;charset=utf-8")


def _fail(method: str, code: str, msg: str, sub_code: str = "", sub_msg: str = "") -> Response:
    value = {"code": code, "msg": msg}
    if sub_code:
        value.update({"sub_code": sub_code, "sub_msg": sub_msg or sub_code})
    return _answer(method, value)


def _business(method: str, sub_code: str, sub_msg: str = "") -> Response:
    return _fail(method, "40004", "Business Failed", sub_code, sub_msg)


def _notify(trade: dict[str, Any], refund: dict[str, Any] | None = None) -> None:
    url = trade.get("notify_url")
    if not url:
        return
    notify_id = STATE.notes.new_id("2026notify")
    # The trade's refunded total when this refund settled (refund_fee is cumulative):
    # every retry of this notification carries the same value.
    refunded_fen = trade["refunded_fen"]

    def build() -> tuple[bytes, dict[str, str]]:
        params = {
            "notify_time": _now(),
            "notify_type": "trade_status_sync",
            "notify_id": notify_id,
            "app_id": APP_ID,
            "charset": "utf-8",
            "version": "1.0",
            "sign_type": "RSA2",
            "trade_no": trade["trade_no"],
            "out_trade_no": trade["out_trade_no"],
            "trade_status": trade["status"],
            "total_amount": trade["total_amount"],
            "subject": trade["subject"],
            "gmt_create": trade["gmt_create"],
        }
        if trade.get("gmt_payment"):
            params["gmt_payment"] = trade["gmt_payment"]
            params["receipt_amount"] = trade["total_amount"]
            params["buyer_pay_amount"] = trade["total_amount"]
        if refund is not None:
            params["out_biz_no"] = refund["out_request_no"]
            params["refund_fee"] = fen_to_yuan(refunded_fen)
            params["gmt_refund"] = refund["gmt_refund"]
        params["sign"] = sign_sha256_rsa(ALIPAY_KEY, signing_string(params, notification=True))
        return urlencode(params).encode(), {
            "Content-Type": "application/x-www-form-urlencoded;charset=utf-8"
        }

    STATE.notes.notify(
        Delivery(
            id=notify_id,
            url=url,
            kind="refund" if refund else trade["status"],
            subject=trade["out_trade_no"],
            build=build,
        )
    )


def _trade_value(trade: dict[str, Any]) -> dict[str, Any]:
    value = {
        "code": "10000",
        "msg": "Success",
        "trade_no": trade["trade_no"],
        "out_trade_no": trade["out_trade_no"],
        "trade_status": trade["status"],
        "total_amount": trade["total_amount"],
        "buyer_logon_id": "159****5620",
    }
    if trade.get("gmt_payment"):
        value["send_pay_date"] = trade["gmt_payment"]
        value["receipt_amount"] = trade["total_amount"]
    return value


async def gateway(request: Request) -> Response:
    raw = await request.body()
    try:
        params = dict(parse_qsl(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=True))
    except (UnicodeDecodeError, ValueError):
        return _fail("", "40001", "Missing Required Arguments", "isv.missing-method")
    method = params.get("method", "")
    if params.get("app_id") != APP_ID:
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-app-id")
    if params.get("sign_type") != "RSA2" or not verify_sha256_rsa(
        APP_PUBLIC_KEY, signing_string(params), params.get("sign", "")
    ):
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-signature")
    for name in ("timestamp", "version", "charset", "biz_content"):
        if not params.get(name):
            return _fail(method, "40001", "Missing Required Arguments", f"isv.missing-{name}")
    if STATE.unavailable > 0:
        STATE.unavailable -= 1
        return _fail(method, "20000", "Service Currently Unavailable", "isp.unknown-error")
    try:
        biz = orjson.loads(params["biz_content"])
    except orjson.JSONDecodeError:
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-biz-content")
    handler = METHODS.get(method)
    if handler is None:
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-method")
    return handler(method, biz, params)


def precreate(method: str, biz: dict[str, Any], params: dict[str, str]) -> Response:
    out_trade_no = biz.get("out_trade_no")
    try:
        fen = yuan_to_fen(str(biz.get("total_amount", "")))
    except ValueError:
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-total-amount")
    if not isinstance(out_trade_no, str) or not biz.get("subject") or fen <= 0:
        return _fail(method, "40002", "Invalid Arguments", "isv.missing-parameter")
    trade = STATE.trades.get(out_trade_no)
    if trade is not None:
        if trade["status"] in ("TRADE_SUCCESS", "TRADE_FINISHED"):
            return _business(method, "ACQ.TRADE_HAS_SUCCESS")
        if trade["total_fen"] != fen:
            return _business(method, "ACQ.CONTEXT_INCONSISTENT")
    else:
        STATE.trade_seq += 1
        trade = {
            "out_trade_no": out_trade_no,
            "trade_no": f"2026120122001{STATE.trade_seq:015d}",
            "total_amount": fen_to_yuan(fen),
            "total_fen": fen,
            "subject": str(biz["subject"]),
            "time_expire": biz.get("time_expire"),
            "notify_url": params.get("notify_url"),
            "status": "PRECREATED",  # not queryable until the buyer scans
            "gmt_create": _now(),
            "refunds": {},
            "refunded_fen": 0,
        }
        STATE.trades[out_trade_no] = trade
    return _answer(
        method,
        {
            "code": "10000",
            "msg": "Success",
            "out_trade_no": out_trade_no,
            "qr_code": f"https://qr.alipay.com/fake{trade['trade_no'][-10:]}",
        },
    )


def _find(biz: dict[str, Any]) -> dict[str, Any] | None:
    if biz.get("out_trade_no"):
        trade = STATE.trades.get(str(biz["out_trade_no"]))
    else:
        trade = next(
            (t for t in STATE.trades.values() if t["trade_no"] == biz.get("trade_no")), None
        )
    return trade if trade is not None and trade["status"] != "PRECREATED" else None


def query(method: str, biz: dict[str, Any], params: dict[str, str]) -> Response:
    trade = _find(biz)
    if trade is None:
        return _business(method, "ACQ.TRADE_NOT_EXIST", "交易不存在")
    return _answer(method, _trade_value(trade))


def refund(method: str, biz: dict[str, Any], params: dict[str, str]) -> Response:
    trade = _find(biz)
    request_no = str(biz.get("out_request_no") or "")
    try:
        fen = yuan_to_fen(str(biz.get("refund_amount", "")))
    except ValueError:
        return _fail(method, "40002", "Invalid Arguments", "isv.invalid-refund-amount")
    if trade is None:
        return _business(method, "ACQ.TRADE_NOT_EXIST")
    existing = trade["refunds"].get(request_no) if request_no else None
    base = {
        "code": "10000",
        "msg": "Success",
        "trade_no": trade["trade_no"],
        "out_trade_no": trade["out_trade_no"],
        "buyer_logon_id": "159****5620",
        "gmt_refund_pay": _now(),
    }
    if existing is not None:
        if existing["fen"] != fen:
            return _business(method, "ACQ.CONTEXT_INCONSISTENT")
        return _answer(
            method, {**base, "fund_change": "N", "refund_fee": fen_to_yuan(trade["refunded_fen"])}
        )
    if trade["status"] not in ("TRADE_SUCCESS", "TRADE_FINISHED"):
        return _business(method, "ACQ.TRADE_STATUS_ERROR")
    if fen <= 0 or trade["refunded_fen"] + fen > trade["total_fen"]:
        return _business(method, "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL", "退款金额超限")
    record = {"out_request_no": request_no or trade["trade_no"], "fen": fen, "gmt_refund": _now()}
    trade["refunds"][record["out_request_no"]] = record
    trade["refunded_fen"] += fen
    if trade["refunded_fen"] == trade["total_fen"]:
        trade["status"] = "TRADE_CLOSED"
    _notify(trade, record)
    return _answer(
        method, {**base, "fund_change": "Y", "refund_fee": fen_to_yuan(trade["refunded_fen"])}
    )


def refund_query(method: str, biz: dict[str, Any], params: dict[str, str]) -> Response:
    trade = _find(biz)
    if trade is None:
        return _business(method, "ACQ.TRADE_NOT_EXIST")
    record = trade["refunds"].get(str(biz.get("out_request_no") or ""))
    value: dict[str, Any] = {
        "code": "10000",
        "msg": "Success",
        "trade_no": trade["trade_no"],
        "out_trade_no": trade["out_trade_no"],
    }
    if record is not None:
        value.update(
            {
                "out_request_no": record["out_request_no"],
                "total_amount": trade["total_amount"],
                "refund_amount": fen_to_yuan(record["fen"]),
                "refund_status": "REFUND_SUCCESS",
            }
        )
    return _answer(method, value)


def close(method: str, biz: dict[str, Any], params: dict[str, str]) -> Response:
    trade = STATE.trades.get(str(biz.get("out_trade_no") or ""))
    if trade is None or trade["status"] == "PRECREATED":
        return _business(method, "ACQ.TRADE_NOT_EXIST")
    if trade["status"] != "WAIT_BUYER_PAY":
        return _business(method, "ACQ.TRADE_STATUS_ERROR")
    trade["status"] = "TRADE_CLOSED"
    _notify(trade)
    return _answer(method, {"code": "10000", "msg": "Success", "trade_no": trade["trade_no"]})


METHODS = {
    "alipay.trade.precreate": precreate,
    "alipay.trade.query": query,
    "alipay.trade.refund": refund,
    "alipay.trade.fastpay.refund.query": refund_query,
    "alipay.trade.close": close,
}


# -- test controls ----------------------------------------------------------------------


async def pay(request: Request) -> Response:
    """The buyer scans the QR code and pays (outcome succeed) or gives up and the
    trade closes (fail). A payment after time_expire is taken, on purpose: a buyer
    on the page at the deadline is the late payment the gate must handle."""
    doc = orjson.loads(await request.body())
    trade = STATE.trades.get(doc.get("out_trade_no", ""))
    if trade is None:
        return JSONResponse({"error": "no such trade"}, 404)
    if trade["status"] not in ("PRECREATED", "WAIT_BUYER_PAY"):
        return JSONResponse({"error": f"trade is {trade['status']}"}, 409)
    if doc.get("trade_no"):
        trade["trade_no"] = str(doc["trade_no"])  # a test's own (one Alipay never issues)
    if doc.get("outcome", "succeed") == "succeed":
        trade["status"] = "TRADE_SUCCESS"
        trade["gmt_payment"] = _now()
    else:
        trade["status"] = "TRADE_CLOSED"
    _notify(trade)
    return JSONResponse(_trade_value(trade))


async def configure(request: Request) -> Response:
    doc = orjson.loads(await request.body())
    STATE.notes.configure(doc)
    STATE.unavailable = int(doc.get("unavailable_calls", STATE.unavailable))
    return JSONResponse({"drop": STATE.notes.drop, "unavailable": STATE.unavailable})


async def trades(request: Request) -> Response:
    trade = STATE.trades.get(request.path_params["out_trade_no"])
    if trade is None:
        return JSONResponse({"error": "no such trade"}, 404)
    return JSONResponse({k: v for k, v in trade.items()})


app = control_app(
    [
        Route("/gateway.do", gateway, methods=["POST"]),
        Route("/_fake/pay", pay, methods=["POST"]),
        Route("/_fake/configure", configure, methods=["POST"]),
        Route("/_fake/trades/{out_trade_no}", trades),
    ],
    STATE.notes,
)

if __name__ == "__main__":
    serve(app, "a local fake of Alipay's open API gateway (tests only)")
