"""Points in time: epoch seconds in the database, ISO 8601 UTC text on output, and `--since` arguments."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
EARLIEST_T = datetime(1, 1, 1, tzinfo=UTC).timestamp()  # the earliest time iso_utc can write
SINCE_HELP = "an ISO time (2024-05-01, 2024-05-01T12:00) or a duration back from now (90s, 30m, 24h, 7d, 2w)"


def parse_since(text: str | float | None, *, now: float | None = None) -> float | None:
    """Epoch seconds from an ISO time ('2024-05-01', '2024-05-01T12:00:00+00:00') or a duration
    back from now ('90s', '30m', '24h', '7d', '2w'). Naive ISO times are local time. Raises ValueError
    with a message fit for the user."""
    if text is None or text == "":
        return None
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if match:
        back_s = float(match.group(1)) * _UNIT_S[match.group(2)]
        # A duration reaching back past the earliest time a date can name means "everything": the earliest.
        return max((now if now is not None else time.time()) - back_s, EARLIEST_T)
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an ISO time such as 2024-05-01T12:00 or a duration "
                         "such as 30m, 24h, 7d") from None
    try:
        return parsed.timestamp()
    except (OverflowError, ValueError, OSError):  # the first hours of year 1 in a zone east of UTC
        return EARLIEST_T


def iso_utc(t: float | None) -> str | None:
    """'2024-05-01T12:00:00+00:00' for epoch seconds (whole seconds; keep the epoch for more)."""
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def epoch_from_iso(text: str) -> float:
    """Epoch seconds of an ISO 8601 time; a time without an offset is taken as UTC."""
    parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def local_minute(t: float | None) -> str | None:
    """'2024-05-01 14:00' in local time, for tables people read."""
    return None if t is None else datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")
