"""What `joulepilot.compile` returns when it does not meter the model: the same interface as a `MeteredModel`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ServedModel:
    """A model served unmetered (no deployment named, or its store cannot be used): call it as the model.

    It has what the README documents of the returned object, as a `MeteredModel` has: `.decision` (what was applied
    and why), `flush()` and `close()` (nothing to write here: they return at once, `flush()` with 0 windows), and use
    as a context manager, so that serving code written for a metered deployment runs unchanged when the store
    cannot be used. Any other attribute is the applied callable's (`compiled`, `config`, `regional`)."""

    def __init__(self, fn: Callable[..., Any], decision: Any) -> None:
        self._fn = fn
        self.decision = decision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def flush(self) -> int:
        """Nothing is metered: no window to write."""
        return 0

    def close(self, timeout_s: float = 30.0) -> None:
        """Nothing is metered: nothing to write or stop."""

    def __enter__(self) -> ServedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, item: str) -> Any:
        # Only reached for names ServedModel lacks: those of the applied callable.
        if item.startswith("__") or "_fn" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self.__dict__["_fn"], item)

    def __repr__(self) -> str:
        config = (getattr(self.decision, "config", None) or {}).get("label")
        return f"ServedModel(config={config!r}, state={getattr(self.decision, 'state', None)!r}, unmetered)"
