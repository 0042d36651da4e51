"""Every side file beside a database imported at a `bench` or daemon start: the runs whose commit failed, then
the deployment windows the store refused.

A refusal that stops one kind stops the other too (`refusals.store_refusal`): with the write lock held by
another process, the start waits one busy timeout in all, not one per file, and says in one line how many
files it left for the next start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .connection import Store
from .deployment_side_files import DeploymentImport, describe_deployment_import, import_deployment_side_files
from .pending import PendingImport, describe_import, import_pending_runs
from .refusals import refused_line


@dataclass
class SideFileImports:
    runs: list[PendingImport]
    deployments: list[DeploymentImport]

    def notes(self) -> list[tuple[str, bool]]:
        """(line, kept) to report: a line per file imported or kept for its own reason, and one for all those
        kept because the database refused; `kept` is True where a file stays for a later import."""
        notes = [(describe_import(item), item.run_id is None) for item in self.runs if item.refused is None]
        notes += [(describe_deployment_import(item), bool(item.error)) for item in self.deployments
                  if item.refused is None]
        items = [*self.runs, *self.deployments]
        refusals = [item.refused for item in items if item.refused is not None]
        if refusals:
            notes.append((refused_line(len(refusals), items[0].path.parent, refusals[0], "at the next start"), True))
        return notes


def import_side_files(db: Store, stop: Callable[[], bool] | None = None) -> SideFileImports:
    """Import the run side files, then the deployment side files, beside `db` (see `import_pending_runs` and
    `import_deployment_side_files`); once the database refuses one file for a reason every file would meet,
    none after it is tried. `stop()` returning True ends a wait for the write lock and the import."""
    runs = import_pending_runs(db, stop)
    refused = next((item.refused for item in runs if item.refused is not None), None)
    return SideFileImports(runs, import_deployment_side_files(db, stop, refused=refused))
