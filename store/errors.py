"""Errors raised by the store. Every message names the database file and what to do."""


class StoreError(RuntimeError):
    """The database cannot be opened, migrated, read or written; the message says what to do."""


class DatabaseMissing(StoreError):
    """A command that only reads was pointed at a database file that does not exist."""


class DatabaseCorrupt(StoreError):
    """The file is not a SQLite database, or not a joulepilot one, or SQLite reports it malformed."""


class SchemaTooNew(StoreError):
    """The database was written by a newer joulepilot."""


class ExportFormatError(StoreError):
    """A runs export file that cannot be read or imported; the message names the file, record and field."""
