"""Shared fixtures: every test gets its own JOULEPILOT_HOME; GPU tests skip without a GPU; `fake_worker` runs
the benchmark workers as tests/fake_worker.py where compiling is not what a test is about."""

from __future__ import annotations

import pytest
from daemon_factories import use_fake_worker


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("jphome")
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    monkeypatch.delenv("JOULEPILOT_DB", raising=False)
    monkeypatch.delenv("JOULEPILOT_POWERCAP_ROOT", raising=False)
    return home


@pytest.fixture
def db(tmp_path):
    from joulepilot.store import open_db

    database = open_db(tmp_path / "test.db")
    yield database
    database.close()


@pytest.fixture
def fake_worker(monkeypatch):
    """Every worker this test starts (in-process `bench`, or a daemon or CLI subprocess, which inherit the
    environment) runs as tests/fake_worker.py: the real worker with eager calls in place of torch.compile."""
    return use_fake_worker(monkeypatch)
