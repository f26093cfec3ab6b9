"""Proxy configuration: a frozen dataclass validated at construction.

Invariants: node URLs are normalized (http(s), no trailing slash); every role has a routing
strategy; the default bind host is loopback.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("encoder", "llm", "prefill", "decode")
STRATEGIES = ("round_robin", "least_loaded", "random")
MODES = ("auto", "colocated", "pd")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"node URL must be an http(s) base URL, got {url!r}")
    return url


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    nodes: tuple[tuple[str, str], ...] = ()  # (url, role) registered at start
    routing: str = "round_robin"
    role_routing: tuple[tuple[str, str], ...] = ()  # (role, strategy) overrides
    mode: str = "auto"
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 2  # consecutive failures that take a node out of rotation
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.routing not in STRATEGIES:
            raise ValueError(f"routing must be one of {STRATEGIES}, got {self.routing!r}")
        for role, strategy in self.role_routing:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} in routing overrides")
            if strategy not in STRATEGIES:
                raise ValueError(f"{role} routing must be one of {STRATEGIES}, got {strategy!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for url, role in self.nodes:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r} for node {url}")
            normalize_url(url)
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health interval and timeout must be positive")
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("request and connect timeouts must be positive")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")

    def routing_for(self, role: str) -> str:
        return dict(self.role_routing).get(role, self.routing)
