"""Small helpers shared by the servers: byte sizes on the command line, wildcard hosts,
public URLs and self-registration with the proxy."""

from __future__ import annotations

import asyncio
import logging
import re
import socket

import httpx

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# SI for k/m/g/t and kb/mb/...; IEC (binary) for ki/kib/mi/mib/...
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_p: 10 ** (3 * _i), _p + "b": 10 ** (3 * _i),
                        _p + "i": 2 ** (10 * _i), _p + "ib": 2 ** (10 * _i)})
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """'256MiB' / '1GiB' / '500MB' / '1048576' (or an int) -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.fullmatch(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 4096, 64MiB, 2GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def is_wildcard_host(host: str) -> bool:
    """True for the 'every interface' binds (0.0.0.0, ::, empty)."""
    return host in WILDCARD_HOSTS


def advertised_host(host: str) -> str:
    """A concrete address peers can reach: a wildcard bind advertises this host's address."""
    if is_wildcard_host(host):
        return socket.gethostbyname(socket.gethostname())
    return host


def public_url(host: str, port: int) -> str:
    """http://host:port for a bound server (IPv6 literals bracketed, wildcards resolved)."""
    host = advertised_host(host)
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


async def register_with_proxy(
    proxy_url: str, url: str, role: str, attempts: int | None = 10
) -> bool:
    """POST {proxy}/nodes/add {url, role} until it succeeds (capped exponential backoff).

    attempts=None retries forever. Returns False when every attempt failed."""
    delay, attempt = 0.5, 0
    async with httpx.AsyncClient(timeout=5.0) as client:
        while attempts is None or attempt < attempts:
            attempt += 1
            try:
                r = await client.post(f"{proxy_url.rstrip('/')}/nodes/add",
                                      json={"url": url, "role": role})
                if r.status_code < 300:
                    logger.info("registered %s as %s with the proxy %s", url, role, proxy_url)
                    return True
                logger.warning("proxy %s refused registration: HTTP %s %s", proxy_url,
                               r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                logger.warning("proxy %s unreachable (attempt %d): %r", proxy_url, attempt, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
    logger.error("could not register with proxy %s; serving anyway", proxy_url)
    return False
