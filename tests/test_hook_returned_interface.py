"""Whatever `joulepilot.compile` returns has what the README documents of it (called as the model, `.decision`,
`close()`; `flush()` and `with` as a metered deployment has them), on every path: a store that is corrupt,
truncated, damaged in its middle pages, read-only, full or unreachable (the deployment is then served unmetered),
no deployment at all, and a policy that cannot be used. The README's `served.close()` used to raise
AttributeError in the serving process whenever the store could not be used."""

from __future__ import annotations

import sqlite3
import warnings
from pathlib import Path

import pytest
import torch
from joulepilot.runtime import MeteredModel
from joulepilot.store import open_db
from joulepilot.store.deployments import register_deployment
from test_cli_errors import _damaged, unwritable

import joulepilot

pytestmark = pytest.mark.filterwarnings("ignore:joulepilot:UserWarning")

POLICY = 'name = "svc"\nworkload = "mlp"\nbatch_size = 8\n[search]\nmodes = ["eager"]\n'


def _full(folder: Path):
    """An open store that SQLite finds full for real (`max_page_count`): deployments fill it until the next one
    does not fit; the hook's own, with its details, is larger than any of them."""
    db = open_db(folder / "full.db")
    db.execute("VACUUM")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        for i in range(100_000):
            register_deployment(db, f"f{i}")
    return db


def _store(kind: str, folder: Path):
    if kind in ("garbage", "truncated", "damaged-pages"):
        return _damaged(kind, folder)
    if kind == "full":
        return _full(folder)
    if kind == "unreachable":  # its folder is a regular file: the database cannot exist
        (folder / "plain-file").write_text("not a folder")
        return folder / "plain-file" / "j.db"
    raise AssertionError(kind)


def _check_interface(served, model: torch.nn.Module) -> None:
    x = torch.ones(2, 4)
    assert torch.equal(served(x), model(x))
    assert served.decision.state and served.decision.config["label"]
    assert served.flush() == 0  # nothing stored, nothing raised
    served.close()
    served.close()  # idempotent, as a metered deployment's
    with served as same:
        assert same is served


@pytest.mark.parametrize("kind", ["garbage", "truncated", "damaged-pages", "full", "unreachable"])
def test_a_deployment_whose_store_cannot_be_used_is_served_with_the_documented_interface(tmp_path, kind):
    policy = tmp_path / "svc.toml"
    policy.write_text(POLICY)
    store = _store(kind, tmp_path)
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = joulepilot.compile(model, policy=str(policy), db=store, deployment=f"svc-{kind}-{'x' * 40}")
    assert not isinstance(served, MeteredModel), type(served)  # served unmetered
    assert any("is not metered" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _check_interface(served, model)
    if not isinstance(store, Path):
        store.close()


def test_a_read_only_store_serves_the_deployment_with_the_documented_interface(tmp_path):
    policy = tmp_path / "svc.toml"
    policy.write_text(POLICY)
    folder = tmp_path / "ro"
    folder.mkdir()
    open_db(folder / "j.db").close()
    model = torch.nn.Linear(4, 2)
    with unwritable(folder):
        served = joulepilot.compile(model, policy=str(policy), db=folder / "j.db", deployment="svc-ro")
        assert not isinstance(served, MeteredModel), type(served)  # served unmetered
        _check_interface(served, model)


def test_no_deployment_and_an_unusable_policy_return_the_same_interface(tmp_path):
    policy = tmp_path / "svc.toml"
    policy.write_text(POLICY)
    model = torch.nn.Linear(4, 2)
    served = joulepilot.compile(model, policy=str(policy), db=tmp_path / "j.db")
    _check_interface(served, model)
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = joulepilot.compile(model, policy=str(broken))
    messages = [str(w.message) for w in caught]
    assert served.decision.state == "fallback" and any("cannot be used" in m for m in messages), messages
    _check_interface(served, model)


def test_a_metered_deployment_keeps_its_interface(tmp_path):
    policy = tmp_path / "svc.toml"
    policy.write_text(POLICY)
    model = torch.nn.Linear(4, 2)
    served = joulepilot.compile(model, policy=str(policy), db=tmp_path / "j.db", deployment="svc-metered")
    try:
        assert isinstance(served, MeteredModel)
        x = torch.ones(2, 4)
        assert torch.equal(served(x), model(x)) and served.decision.state
    finally:
        served.close()
