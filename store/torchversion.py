"""Torch versions as runs and decisions are grouped by: major.minor."""

from __future__ import annotations


def torch_major_minor(version: str | None) -> str:
    """'2.13' from '2.13.0+cpu' (or from '2.13'); '0.0' when no version was recorded."""
    parts = (version or "0.0").split("+")[0].split(".")
    return ".".join(parts[:2])
