"""/docs: Swagger UI over the gate's own /openapi.json, every file from the gate itself
(no CDN), on with GATE_DOCS=1 or GATE_ENV=dev only, 404 otherwise."""

from __future__ import annotations

import asyncio
import re

import pytest

from gate.base.settings import SettingsError, load_settings
from tests.support import Client, GateProcess


async def test_docs_serve_the_page_and_every_asset_from_the_gate(env: dict[str, str]) -> None:
    gate = GateProcess({**env, "GATE_DOCS": "1"}, background=False)
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        page = await client.get("/docs")
        assert page.status_code == 200, page.text
        assert page.headers["Content-Type"] == "text/html; charset=utf-8"
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        assert '<div id="swagger-ui"></div>' in page.text
        # Everything the page loads is relative: it comes from the gate, not a CDN.
        refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert refs and all(not re.match(r"^[a-z]+:|^//", r) for r in refs), refs
        kinds = {}
        for ref in refs:
            asset = await client.get("/" + ref)
            assert asset.status_code == 200, (ref, asset.text[:200])
            assert len(asset.content) > 0
            kinds[ref] = asset.headers["Content-Type"]
            assert asset.headers["X-Content-Type-Options"] == "nosniff"
        assert kinds["docs/swagger-ui.css"].startswith("text/css")
        assert kinds["docs/swagger-ui-bundle.js"].startswith("text/javascript")
        assert kinds["docs/favicon-32x32.png"] == "image/png"
        bundle = (await client.get("/docs/swagger-ui-bundle.js")).text
        assert "SwaggerUIBundle" in bundle
        # Swagger UI 5: renders the gate's OpenAPI 3.1 document (4.x refuses it).
        assert re.search(r'"5\.\d+\.\d+"', bundle)
        init = (await client.get("/docs/gate-init.js")).text
        assert 'new URL("openapi.json", document.baseURI)' in init
        assert "validatorUrl: null" in init
        doc = await client.get("/openapi.json")
        assert doc.status_code == 200 and doc.json()["openapi"].startswith("3.1")
        # Only the fixed files: anything else is a 404 problem, never a file read.
        for path in ("/docs/index.html", "/docs/..%2Fsettings.py", "/docs/swagger-ui.js.map"):
            missing = await client.get(path)
            assert missing.status_code == 404, path
            assert missing.headers["Content-Type"] == "application/problem+json"
    finally:
        await client.close()
        gate.stop()


async def test_docs_are_404_when_off(client: Client) -> None:
    # The shared gate runs with GATE_ENV=test and no GATE_DOCS.
    for path in ("/docs", "/docs/swagger-ui-bundle.js", "/docs/gate-init.js"):
        r = await client.get(path)
        assert r.status_code == 404, path
        assert r.headers["Content-Type"] == "application/problem+json"


def test_docs_setting(env: dict[str, str]) -> None:
    assert load_settings(env).docs is False
    assert load_settings({**env, "GATE_DOCS": "1"}).docs is True
    assert load_settings({**env, "GATE_ENV": "dev"}).docs is True
    assert load_settings({**env, "GATE_ENV": "dev", "GATE_DOCS": "0"}).docs is False
    assert load_settings({**env, "GATE_ENV": "production"}).docs is False
    with pytest.raises(SettingsError, match="GATE_DOCS"):
        load_settings({**env, "GATE_DOCS": "maybe"})
