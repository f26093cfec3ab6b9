"""A proxy that runs `check_integrity()` after every method call of the wrapped object."""

from __future__ import annotations

from typing import Any


class Checked:
    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.target.check_integrity()

        return call

    def __contains__(self, item: object) -> bool:
        return item in self.target
