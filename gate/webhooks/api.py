"""The webhook endpoints' admin API (docs/api.md, "admin"; GATE_ADMIN_TOKEN).

POST   /v1/admin/webhook-endpoints                     create ──> 201 + secret
GET    /v1/admin/webhook-endpoints                     list
GET    /v1/admin/webhook-endpoints/{id}                one, with its stats
PATCH  /v1/admin/webhook-endpoints/{id}                url, events, description, status
DELETE /v1/admin/webhook-endpoints/{id}                204
POST   /v1/admin/webhook-endpoints/{id}/rotate-secret  200 {"secret"}
GET    /v1/admin/webhook-endpoints/{id}/deliveries     ?status=&limit=1..100&after=
POST   /v1/admin/webhook-endpoints/{id}/deliveries/{delivery_id}/retry   202
POST   /v1/admin/webhook-endpoints/{id}/test           202: a webhook.test event
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gate.web.http_io import json_response, read_json
from gate.webhooks.service import WebhookService

if TYPE_CHECKING:
    from gate.runtime import Gate

BASE = "/v1/admin/webhook-endpoints"


def routes(service: WebhookService) -> list[BaseRoute]:
    def admin(request: Request) -> Gate:
        gate: Gate = request.app.state.gate
        gate.admin_auth.check(request.headers.get("authorization"))
        return gate

    def endpoint_id(request: Request) -> str:
        return str(request.path_params["endpoint_id"])

    async def create(request: Request) -> Response:
        gate = admin(request)
        body = await read_json(request, gate.settings.body_max_bytes)
        return json_response(await service.create(body), 201)

    async def listing(request: Request) -> Response:
        admin(request)
        return json_response({"endpoints": await service.list()})

    async def show(request: Request) -> Response:
        admin(request)
        return json_response(await service.show(endpoint_id(request)))

    async def update(request: Request) -> Response:
        gate = admin(request)
        body = await read_json(request, gate.settings.body_max_bytes)
        return json_response(await service.update(endpoint_id(request), body))

    async def delete(request: Request) -> Response:
        admin(request)
        await service.delete(endpoint_id(request))
        return Response(status_code=204)

    async def rotate(request: Request) -> Response:
        admin(request)
        return json_response(await service.rotate(endpoint_id(request)))

    async def deliveries(request: Request) -> Response:
        admin(request)
        query = dict(request.query_params)
        return json_response(await service.deliveries(endpoint_id(request), query))

    async def retry(request: Request) -> Response:
        admin(request)
        delivery_id = int(request.path_params["delivery_id"])
        return json_response(await service.retry(endpoint_id(request), delivery_id), 202)

    async def test(request: Request) -> Response:
        admin(request)
        return json_response(await service.send_test(endpoint_id(request)), 202)

    one = BASE + "/{endpoint_id:str}"
    return [
        Route(BASE, create, methods=["POST"]),
        Route(BASE, listing, methods=["GET"]),
        Route(one, show, methods=["GET"]),
        Route(one, update, methods=["PATCH"]),
        Route(one, delete, methods=["DELETE"]),
        Route(one + "/rotate-secret", rotate, methods=["POST"]),
        Route(one + "/deliveries", deliveries, methods=["GET"]),
        Route(one + "/deliveries/{delivery_id:id}/retry", retry, methods=["POST"]),
        Route(one + "/test", test, methods=["POST"]),
    ]
