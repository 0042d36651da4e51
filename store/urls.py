"""Database and server URLs: which settings name a PostgreSQL database, and how a URL is shown (no password)."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str | os.PathLike | None) -> bool:
    """Whether a --db / JOULEPILOT_DB / daemon `db` value names a PostgreSQL database rather than a SQLite file."""
    return isinstance(target, str) and target.lower().startswith(POSTGRES_SCHEMES)


def has_password(url: str) -> bool:
    """Whether `url` carries a password (in its user part or a `password=` parameter)."""
    try:
        parts = urlsplit(url)
        return parts.password is not None or re.search(r"(^|&)password=", parts.query) is not None
    except ValueError:
        return False


def redacted(url: str) -> str:
    """`url` with its password, if any (in its user part or a `password=` parameter), replaced by '***' (URLs are
    logged, printed and stored)."""
    try:
        parts = urlsplit(url)
        if "password=" in parts.query:
            query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query)
            url = url.replace(f"?{parts.query}", f"?{query}", 1)
            parts = parts._replace(query=query)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<a malformed URL>"
