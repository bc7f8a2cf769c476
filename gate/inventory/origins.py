"""Web origins as the waiting room's settings take them ("https://host[:port]"): the
buyer page's return origins and the host of its help link (gate/inventory/room_config.py,
gate/inventory/room_page.py)."""

from __future__ import annotations

import re
from typing import Any

from gate.base.errors import invalid

RETURN_ORIGIN_CHARS_MAX = 100
_ORIGIN_RE = re.compile(
    r"(?P<scheme>https?)://(?P<host>[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*"
    r"|\[::1\])(?::(?P<port>[0-9]{1,5}))?"
)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_PORTS = {"https": 443, "http": 80}


def parse_origin(origin: Any, name: str) -> str:
    shape = (
        f"'{name}' must be an origin such as \"https://shop.example\" or"
        ' "https://shop.example:8443": https (http only for localhost, 127.0.0.1'
        f" and [::1]), no path, at most {RETURN_ORIGIN_CHARS_MAX} characters."
    )
    if not isinstance(origin, str) or len(origin) > RETURN_ORIGIN_CHARS_MAX:
        raise invalid(shape)
    match = _ORIGIN_RE.fullmatch(origin.lower())
    if match is None:
        raise invalid(shape)
    scheme, host, port = match["scheme"], match["host"], match["port"]
    if scheme == "http" and host not in LOOPBACK_HOSTS:
        raise invalid(shape)
    if port is not None:
        number = int(port)
        if not 1 <= number <= 65535:
            raise invalid(shape)
        port = None if number == DEFAULT_PORTS[scheme] else str(number)
    return f"{scheme}://{host}" + (f":{port}" if port else "")
