"""Errors raised by the store."""


class StoreError(RuntimeError):
    """The database cannot be opened, migrated or written; the message says what to do."""
