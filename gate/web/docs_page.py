"""A human-readable reference of /openapi.json at /docs: Swagger UI, served by the gate
itself from the files of a PyPI package, so the page works with no access to the
internet (no CDN) and shows exactly the document the gate serves.

    GET /docs                 the page (HTML): loads the three files below, nothing else
    GET /docs/swagger-ui.css  |
    GET /docs/swagger-ui-bundle.js   from the swagger-ui-py package (Swagger UI 5, which
    GET /docs/favicon-32x32.png      renders OpenAPI 3.1; swagger-ui-bundle ships 4.15,
    GET /docs/gate-init.js    |      which refuses 3.1 documents)
                              ours: SwaggerUIBundle({url: "/openapi.json", …})

Off unless GATE_DOCS=1 (default on with GATE_ENV=dev only): the routes do not exist,
so /docs answers the router's 404. The routes are not in the OpenAPI document (they
are not part of the API). Files are read once, from a fixed list (no path from the
request reaches the file system) when the app is built, and kept: about 1.6 MB per
process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gate.base.errors import not_found

PACKAGE = "swagger_ui"
ASSETS = {
    "swagger-ui.css": "text/css; charset=utf-8",
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
ASSET_CACHE_SECONDS = 86_400
# Only the gate's own origin: a page that tried to load anything from elsewhere (a
# CDN, the online validator) would be blocked by the browser, not just unneeded.
# Swagger UI sets inline styles and shows images as data: URLs.
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline';"
    " frame-ancestors 'none'"
)

# Relative URLs: /docs/x from /docs, /openapi.json from there, also under a root_path.
PAGE = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Gate API reference</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/gate-init.js"></script>
</body>
</html>
"""

INIT = b"""window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: new URL("openapi.json", document.baseURI).href,
    dom_id: "#swagger-ui",
    deepLinking: true,
    // No request to the online validator: the page works offline.
    validatorUrl: null,
  });
});
"""


def static_dir() -> Path | None:
    """Where the package keeps Swagger UI's files, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def available() -> bool:
    root = static_dir()
    return root is not None and all((root / name).is_file() for name in ASSETS)


_HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP}


def routes() -> list[BaseRoute]:
    root = static_dir()
    assert root is not None, "checked at start-up (GATE_DOCS)"
    # Read when the app is built, not in a handler (no blocking file I/O on the loop).
    files = {name: (root / name).read_bytes() for name in ASSETS}

    async def page(request: Request) -> Response:
        return Response(PAGE, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        cache_control = {"Cache-Control": f"public, max-age={ASSET_CACHE_SECONDS}"}
        if name == "gate-init.js":
            return Response(
                INIT,
                media_type=ASSETS["swagger-ui-bundle.js"],
                headers={**_HEADERS, **cache_control},
            )
        body = files.get(name)
        if body is None:
            raise not_found("file")
        return Response(body, media_type=ASSETS[name], headers={**_HEADERS, **cache_control})

    return [
        Route("/docs", page, methods=["GET"]),
        Route("/docs/{name:str}", asset, methods=["GET"]),
    ]
