"""SQLite store: schema, migrations, typed reads and writes."""

from .db import default_db_path, default_home, migrate, open_db, schema_version, transaction
from .decisions import latest_decision, list_decisions, write_decision
from .deployments import (
    get_deployment,
    insert_samples,
    insert_violation,
    list_deployments,
    list_violations,
    read_samples,
    register_deployment,
    violated_config_ids,
)
from .errors import StoreError
from .exchange import export_runs, import_runs, read_export, write_export
from .records import (
    host_identity,
    insert_run,
    list_runs,
    power_samples,
    stable_id,
    upsert_config,
    upsert_devices,
    upsert_host,
    upsert_workload,
)
from .schema import SCHEMA_VERSION

__all__ = [
    "get_deployment",
    "insert_samples",
    "insert_violation",
    "list_deployments",
    "list_violations",
    "read_samples",
    "register_deployment",
    "violated_config_ids",
    "SCHEMA_VERSION",
    "StoreError",
    "default_db_path",
    "default_home",
    "export_runs",
    "import_runs",
    "read_export",
    "write_export",
    "host_identity",
    "insert_run",
    "latest_decision",
    "list_decisions",
    "write_decision",
    "list_runs",
    "migrate",
    "open_db",
    "power_samples",
    "schema_version",
    "stable_id",
    "transaction",
    "upsert_config",
    "upsert_devices",
    "upsert_host",
    "upsert_workload",
]
