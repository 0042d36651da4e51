"""Shared fixtures: every test gets its own JOULEPILOT_HOME; GPU tests skip without a GPU; `fake_worker` runs the
benchmark workers as tests/fake_worker.py where compiling is not what a test is about, and `flow_worker` as
tests/flow_worker.py (no torch, a stand-in model) where the model is not either; `own_tmpdir` gives a test a
temporary directory of its own."""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile

# One OpenMP thread, set before torch is imported here or in any process a test starts (they inherit it): a
# test often runs two torch processes at once (pytest and a worker, a daemon and its worker) on a small machine,
# where spinning OpenMP threads only fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor checks which vector instruction sets the C++ compiler can build by compiling and loading a test program
# for each (about 7 s of CPU to build them, a second to load them). Told that the CPU's flags can be trusted, it
# picks the same instruction set without most of them; the compiles the tests are about still run, C++ kernels
# included. The test of host_isa.py lifts it. The programs Inductor still builds then (its AVX-512 BF16, VNNI and
# AMX checks, about 1.5 s of CPU per compile) are built once for the whole run and every later run on this machine,
# as a host does (compiler/host_isa.py), in one folder that bench and the daemon copy into every CPU job's cache.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ.setdefault("JOULEPILOT_VEC_ISA_DIR", os.path.join(tempfile.gettempdir(), "joulepilot-test-vec-isa"))
# The suite starts a few hundred Python processes (workers, zygotes, daemons, CLI runs) that import the same
# modules. With PYTHONDONTWRITEBYTECODE set (as on some CI images) none of them caches its bytecode, so each
# compiles joulepilot's modules from source again, and each pytest process rewrites every test module's asserts
# again. Bytecode is then written for this run and the processes it starts, outside the source tree (a
# PYTHONPYCACHEPREFIX folder in the temporary directory, so the tree stays as the variable asked); the first
# process to import a module compiles it for the others.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = os.path.join(tempfile.gettempdir(),
                                                                          "joulepilot-test-pycache")
    sys.dont_write_bytecode = False

# The processes the suite starts (pytest-xdist's included) find tests/coverage_boot/sitecustomize.py first on their
# path: where coverage measures them, it pauses the tracer while torch imports and compiles (it says why).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(os.path.dirname(os.path.abspath(__file__)), "coverage_boot"),
     *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])

import process_state  # noqa: E402
import pytest  # noqa: E402
from daemon_factories import use_fake_worker, use_flow_worker  # noqa: E402


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _whole_suite(config) -> bool:
    """Whether pytest runs the suite from testpaths (`python3 -m pytest -q`) rather than tests named on its
    command line or chosen by `-m`/`-k` (`python3 -m pytest -m gpu` runs ten tests on a GPU host)."""
    chosen = getattr(config.option, "markexpr", "") or getattr(config.option, "keyword", "")
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not chosen


def pytest_xdist_auto_num_workers(config):
    """How many processes `-n auto` (in pyproject's addopts) runs tests on: for the whole CPU suite two more than
    the cores (at most 6). A quarter of the tests' time is waiting (for a signal to land, a budget to run out, a
    daemon to start, a window's sleeps), which the extra processes' tests fill: on the 2-core VM the suite took
    183-191 s with four processes against 191-211 s with three. The daemon's and the CLI's flow tests measure
    with the flow worker, whose calls mostly sleep, so sharing a core does not get their runs flagged "repeat
    this run" (those that count runs make its calls longer); the tests with real workers allow for a flagged
    run. One process (0) for chosen tests, and for the GPU tests, whose energy windows must not share the
    machine."""
    if not _whole_suite(config) or "gpu" in (config.option.markexpr or ""):
        return 0
    return max(1, min(6, len(os.sched_getaffinity(0)) + 2))


def pytest_configure(config):
    # The coverage floor is the whole suite's: a run of chosen tests neither fails under it nor prints the table
    # (unless --cov-report is given).
    coverage_plugin = config.pluginmanager.get_plugin("_cov")
    if coverage_plugin is not None and not _whole_suite(config):
        coverage_plugin.options.cov_fail_under = 0
        if not any(str(arg).startswith("--cov-report") for arg in config.invocation_params.args):
            coverage_plugin.options.cov_report = {}


_STARTS_PROCESSES = ("subprocess.", "run_worker_job(", "bench(", "start_daemon(", "daemon_cmd(", "CliRunner")
# Files whose tests mostly wait, on the fake NVML's or powercap's clock (counters that step every 100 ms) or in
# sleeps: spread among the others rather than run together, when every process would wait and the cores idle.
_WAITS = ("from fakes", "import fakes", "time.sleep(")


def _weight(item, module_text: dict) -> int:
    """Longest first: files marked slow (tens of seconds), then tests that start workers or daemons, then the rest."""
    if item.get_closest_marker("slow"):
        return 0
    if {"fake_worker", "own_tmpdir"} & set(getattr(item, "fixturenames", ())):
        return 1
    return 2 if any(marker in _text(item, module_text) for marker in _STARTS_PROCESSES) else 3


def _text(item, module_text: dict) -> str:
    path = str(getattr(item, "path", ""))
    if path not in module_text:
        try:
            module_text[path] = open(path, encoding="utf-8").read()
        except OSError:
            module_text[path] = ""
    return module_text[path]


def _file_order(items, module_text: dict) -> dict:
    """Each file's place in the order pytest-xdist hands tests out: by `_weight`, except that the files that
    mostly wait are spread evenly over the first half of those of weight 2 and 3 (the later files are quick)."""
    weight: dict = {}
    for item in items:
        path = str(getattr(item, "path", ""))
        weight[path] = min(weight.get(path, 3), _weight(item, module_text))
    files = sorted(weight, key=weight.get)  # stable: collection order within a weight
    waits = [p for p in files if weight[p] >= 2 and any(m in module_text.get(p, "") for m in _WAITS)]
    busy = [p for p in files if weight[p] >= 2 and p not in waits]
    place = {p: (0, i) for i, p in enumerate(p for p in files if weight[p] < 2)}
    place.update({p: (1, (i + 0.5) / len(busy)) for i, p in enumerate(busy)})
    place.update({p: (1, 0.5 * (i + 0.5) / len(waits)) for i, p in enumerate(waits)})
    return place


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # pytest-xdist hands out the files (`--dist loadfile`) in this order: files with long tests first, so that no
    # process is left with a long file at the end while the others idle, and files that mostly wait among the
    # others. pytest-randomly has shuffled the files and each file's tests before this hook (its own is a wrapper
    # that runs first); the sort is stable, so within a weight the files keep that order, and a file its tests'.
    if _whole_suite(config):
        place = _file_order(items, {})
        items.sort(key=lambda item: place[str(getattr(item, "path", ""))])
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    """The order's seed, at the end where a failure is read (pytest -q prints no header): the same command with
    `-p randomly --randomly-seed=N` runs the tests in the same order again."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int) and config.option.randomly_reorganize:
        terminalreporter.write_line(f"tests in random order: replay it with -p randomly --randomly-seed={seed}, "
                                    "or run them in file order with -p no:randomly")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    # At the end of each test process pytest collects garbage five times over, to report exceptions raised by
    # finalizers. With torch, Dynamo and Inductor loaded each pass walks about a million objects (a third of a
    # second here, on the path to the run's end): one pass now collects the garbage (and its finalizers report as
    # they would), and what survives it is frozen out of pytest's passes.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _guard_process_state():
    """Fails a test that leaves process-wide state changed (tests/process_state.py says which), and puts it back so
    that the tests after it are not failed too. Named to sort first among the autouse fixtures: it is set up
    before and torn down after the others, monkeypatch's undo included."""
    before = process_state.snapshot()
    yield
    process_state.left_threads(before)  # gives the test's threads their moment to end
    after = process_state.snapshot()
    changed = process_state.changes(before, after)
    if changed:
        process_state.put_back(before, after)
        pytest.fail(f"the test left process-wide state changed: {', '.join(changed)} (change it for the test "
                    "only: monkeypatch.setenv, torch._dynamo.config.patch(...) as a context, try/finally)",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("jphome")
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    monkeypatch.delenv("JOULEPILOT_DB", raising=False)
    monkeypatch.delenv("JOULEPILOT_POWERCAP_ROOT", raising=False)
    # Tables are as wide as COLUMNS says: unset, as off a terminal (pytest-xdist's workers set it to 80).
    monkeypatch.delenv("COLUMNS", raising=False)
    return home


@pytest.fixture
def db(tmp_path):
    from joulepilot.store import open_db

    database = open_db(tmp_path / "test.db")
    yield database
    database.close()


@pytest.fixture
def own_tmpdir(tmp_path_factory, monkeypatch):
    """A temporary directory for this test alone (TMPDIR for the processes it starts, and tempfile's here).

    Workers' scratch folders go there, and every `bench` or daemon start removes those of dead owners: a test
    that checks what a killed process left behind must not see another test's start (on another xdist
    worker) clean it up first. Other tests keep the usual one, where torch keeps its compile caches."""
    folder = tmp_path_factory.mktemp("tmp")
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def fake_worker(monkeypatch):
    """Every worker this test starts (in-process `bench`, or a daemon or CLI subprocess, which inherit the
    environment) runs as tests/fake_worker.py: the real worker with eager calls in place of torch.compile."""
    return use_fake_worker(monkeypatch)


@pytest.fixture
def flow_worker(monkeypatch):
    """Every worker this test starts runs as tests/flow_worker.py: the worker's files, phases, zygote protocol,
    meter and timing loops without torch, on a stand-in for the model, for tests about the daemon's and the
    CLI's flow (it refuses, with the reason, a job that needs a model or a compiler)."""
    return use_flow_worker(monkeypatch)


@pytest.fixture(autouse=True)
def restore_logging():
    """The `joulepilot` logger as it was before the test: the daemon, run in this process, sets it up (its own
    handler, no propagation to the root, where caplog listens). For every test, so that one which runs the
    daemon in this process cannot leave the next test's log records unseen."""
    logger = logging.getLogger("joulepilot")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


@pytest.fixture
def live_children():
    """Lists this process's live descendants that the test started: children that were already there when it
    began (multiprocessing's resource tracker, or the session's PostgreSQL server, left by an earlier test on the
    same xdist worker) are not its, nor what they start meanwhile (the server's backends and autovacuum
    workers)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    def theirs(proc) -> bool:
        parent = proc.parent()
        while parent is not None and parent.pid != me.pid:
            if parent.pid in before:
                return True
            parent = parent.parent()
        return False

    def live() -> list:
        found = []
        for proc in me.children(recursive=True):
            try:
                if proc.pid not in before and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE \
                        and not theirs(proc):
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        return found

    return live



@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL cluster for the session's process (skipped where the package is not installed)."""
    import servers

    server = servers.start_postgres()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend_target(request, tmp_path):
    """A new database on each of the store's backends: a SQLite file's path, a PostgreSQL database's URL."""
    if request.param == "sqlite":
        return tmp_path / "test.db"
    return request.getfixturevalue("postgres_server").new_database()


@pytest.fixture
def backend_db(backend_target):
    from joulepilot.store import open_db

    database = open_db(backend_target)
    yield database
    database.close()
