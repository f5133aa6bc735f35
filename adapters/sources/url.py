"""The one check every HTTP source makes of its configured URL."""

from __future__ import annotations

import httpx

from core import ConfigError

__all__ = ["check_url"]


def check_url(where: str, url: str) -> None:
    """ConfigError naming ``where`` unless ``url`` is a usable http(s) URL."""
    try:
        port = httpx.URL(url).port
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigError(f"{where}.url: {exc}") from None
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"{where}.url: port {port} is not in 1-65535")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.url: expected an http(s) URL, got {url!r}")
