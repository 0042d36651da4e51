"""The worker zygote: one process per workload imports torch and builds the model once, and each
configuration's worker is forked from it, with compile caches of its own; where forking is not safe the
jobs run as fresh processes. Cache isolation is checked with real Inductor compiles (marked slow)."""

from __future__ import annotations

import glob
import os
import signal
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from daemon_factories import wait_for
from joulepilot.compiler import CompileConfig, bench, worker_budget
from joulepilot.compiler.artifacts import KERNEL_SUFFIXES, kernels_path
from joulepilot.compiler.bench import worker_job_key
from joulepilot.compiler.host_isa import (
    PROGRAMS_DIR_ENV,
    ensure_programs,
    job_compiles_on_cpu,
    programs_dir,
    programs_to_build,
)
from joulepilot.compiler.runner import phase_text, read_phases, run_worker_job, start_zygote_early
from joulepilot.compiler.workloads import can_prebuild
from joulepilot.compiler.zygote import FORK_WORKERS_ENV, FORKED, FRESH, ZygotePool


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    # the zygote and the workers import tests.workload_factories through the parent's import roots
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def _job(spec: str, config: CompileConfig, **extra) -> dict:
    return {"kind": "bench", "spec": spec, "device": "cpu", "config": config.to_row(), "min_seconds": 0.2,
            "idle_power_w": {}, **extra}


def test_each_configuration_is_forked_from_one_zygote_per_workload(fake_worker, own_tmpdir, live_children):
    budget = worker_budget(120, 0.2)
    parents: list[int] = []

    def started(pid: int) -> None:
        parents.append(psutil.Process(pid).ppid())

    with ZygotePool() as pool:
        first = run_worker_job(_job("mlp", CompileConfig(mode="eager")), budget=budget, zygotes=pool, on_start=started)
        zygote = pool.current
        assert zygote is not None
        second = run_worker_job(_job("mlp", CompileConfig(mode="default")), budget=budget, zygotes=pool,
                                on_start=started)
        assert pool.current is zygote
        assert zygote.info["fork_safe"] and zygote.info["built"]
        assert {"torch", "torch.utils.flop_counter", "joulepilot.compiler.measure"} <= set(zygote.info["preloaded"])
        assert zygote.info["compiler"] == "loaded"  # on a CPU device, before the first fork
        # Nothing is ever compiled in the zygote: its own cache folder stays empty.
        assert not any((zygote.workdir / "inductor-cache").rglob("*"))
        other = run_worker_job(_job("mlp", CompileConfig(mode="eager"), seq_len=None, image_size=7),
                               budget=budget, zygotes=pool, on_start=started)
        assert pool.current is not zygote and zygote.proc.poll() is not None  # a new workload, a new zygote
        assert not zygote.workdir.exists()
    assert [r["status"] for r in (first, second, other)] == ["ok", "ok", "ok"], (first, second, other)
    assert {r["worker_process"] for r in (first, second, other)} == {FORKED}
    assert parents[:2] == [zygote.pid, zygote.pid] and parents[2] != zygote.pid
    assert not live_children()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{os.getpid()}-*"))


def test_a_zygote_started_early_serves_its_workload_and_is_closed_for_another(flow_worker, own_tmpdir, live_children):
    budget = worker_budget(120, 0.2)
    with ZygotePool() as pool:
        start_zygote_early(pool, worker_job_key("mlp", CompileConfig(mode="eager"), "cpu", None, None))
        early = pool.pending
        assert early is not None and pool.current is None
        result = run_worker_job(_job("mlp", CompileConfig(mode="eager")), budget=budget, zygotes=pool)
        assert result["worker_process"] == FORKED and pool.current is early and pool.pending is None
    with ZygotePool() as pool:
        start_zygote_early(pool, worker_job_key("mlp", CompileConfig(mode="eager"), "cpu", None, 7))
        other = pool.pending
        result = run_worker_job(_job("mlp", CompileConfig(mode="eager")), budget=budget, zygotes=pool)
        assert result["status"] == "ok" and pool.current is not other and other.proc.poll() is not None
    assert not live_children()


def test_a_zygote_outlives_the_measuring_thread_that_first_asked_for_it(flow_worker, own_tmpdir):
    """A sweep over several GPUs runs each job on a thread that ends with the job, and the kernel's
    PR_SET_PDEATHSIG follows the thread that started a process: the pool starts its zygotes on a thread of
    its own, so the device's next jobs are forked from the same zygote."""
    budget = worker_budget(120, 0.2)
    results: list[dict] = []
    parents: list[int] = []
    with ZygotePool() as pool:
        for mode in ("eager", "default", "eager"):
            job = _job("mlp", CompileConfig(mode=mode))
            thread = threading.Thread(target=lambda job=job: results.append(run_worker_job(
                job, budget=budget, zygotes=pool, on_start=lambda pid: parents.append(psutil.Process(pid).ppid()))))
            thread.start()
            thread.join(120)
            assert not thread.is_alive()
            time.sleep(0.3)  # a zygote killed with its thread would be gone by now
            assert pool.current is not None and pool.current.proc.poll() is None
        zygote = pool.current
    assert [r["worker_process"] for r in results] == [FORKED] * 3, results
    assert parents == [zygote.pid] * 3


def test_a_bench_sweep_forks_its_workers_and_leaves_no_zygote(db, flow_worker, own_tmpdir, live_children):
    runs = bench("mlp", [CompileConfig(mode="eager"), CompileConfig(mode="eager", precision="bf16")], device="cpu",
                 min_seconds=0.2, db=db, idle_s=0)
    assert [r["status"] for r in runs] == ["ok", "ok"]
    assert [r["extra"]["worker_process"] for r in runs] == [FORKED, FORKED]
    for run in runs:  # the job's wall time covers its parts (the first also starts the zygote)
        extra = run["extra"]
        assert extra["job_wall_s"] >= run["compile_s"] + run["warmup_s"] + extra["latency_s"] + run["window_s"]
    assert not live_children()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{os.getpid()}-*"))


def test_fork_workers_off_runs_fresh_processes(db, flow_worker, monkeypatch):
    monkeypatch.setenv(FORK_WORKERS_ENV, "0")
    (run,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0)
    assert run["status"] == "ok"
    assert run["extra"]["worker_process"] == f"{FRESH} ({FORK_WORKERS_ENV}=0)"


def test_a_forked_worker_uses_torchs_thread_count_after_a_parallel_build(db, monkeypatch):
    """The zygote builds with one intra-op thread (an OpenMP pool in it would hang the forked worker's first
    parallel region), and each worker runs with torch's own count, as a fresh process does."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    spec = "tests.workload_factories:parallel_at_build"
    (forked,) = bench(spec, [CompileConfig(mode="eager")], device="cpu", min_seconds=0.3, db=db, idle_s=0,
                      budget_s=60)
    assert forked["status"] == "ok", forked["reason"]
    assert forked["extra"]["worker_process"] == FORKED
    monkeypatch.setenv(FORK_WORKERS_ENV, "0")
    (fresh,) = bench(spec, [CompileConfig(mode="eager")], device="cpu", min_seconds=0.3, db=db, idle_s=0,
                     budget_s=60, force=True)
    assert fresh["status"] == "ok" and fresh["extra"]["worker_process"].startswith(FRESH)
    assert forked["extra"]["torch_threads"] == fresh["extra"]["torch_threads"] == 2


def test_a_module_that_starts_a_thread_at_import_is_run_in_fresh_processes(db, tmp_path, fake_worker):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nimport torch\n"
        "threading.Thread(target=time.sleep, args=(600,), name='poller', daemon=True).start()\n"
        "def build(batch_size=1):\n    return torch.nn.Linear(4, 4), (torch.randn(batch_size, 4),)\n")
    (run,) = bench(f"{tmp_path / 'threaded.py'}:build", [CompileConfig(mode="eager")], device="cpu",
                   min_seconds=0.2, db=db, idle_s=0)
    assert run["status"] == "ok", run["reason"]
    assert run["extra"]["worker_process"] == f"{FRESH} (preloading started 1 Python thread(s) (poller))"


def test_a_worker_whose_zygote_dies_fails_with_the_reason_and_the_next_job_gets_a_new_zygote(fake_worker, own_tmpdir, live_children):
    budget = worker_budget(120, 0.2)
    hang = _job("tests.workload_factories:hangs_on_first_call", CompileConfig(mode="eager"))
    with ZygotePool() as pool:
        workdirs: list[Path] = []

        def kill_zygote_in_reference(kind: str, phase: str) -> None:
            if phase == "reference":
                os.kill(pool.current.pid, signal.SIGKILL)

        result = run_worker_job(hang, budget=budget, zygotes=pool, on_phase=kill_zygote_in_reference, keep_dir=True)
        workdirs.append(Path(result["workdir"]))
        first_zygote = pool.current
        assert result["status"] == "failed"
        assert result["reason"].startswith("worker killed by SIGKILL during reference")
        assert "its zygote process died" in result["reason"]
        wait_for(lambda: not [p for p in live_children() if p.pid != first_zygote.pid], 15, "the worker to die with its zygote")
        fine = run_worker_job(_job("tests.workload_factories:hangs_on_first_call", CompileConfig(mode="eager")),
                              budget=worker_budget(3, 0.2), zygotes=pool, keep_dir=True)
        workdirs.append(Path(fine["workdir"]))
        assert pool.current is not first_zygote and fine["worker_process"] == FORKED
        assert fine["reason"] == "the first forward call (eager reference) exceeded the compile budget of 3 s"
        assert [p for p, _ in read_phases(workdirs[1] / "phases.tsv")][-1] == "reference"


def test_a_prebuilt_workload_is_the_one_a_worker_would_build_and_is_handed_out_once():
    import torch
    from joulepilot.compiler.workloads import load_workload, prebuild_workload

    built = prebuild_workload("mlp", batch_size=3, seq_len=None, image_size=None, seed=7)
    handed = load_workload("mlp", batch_size=3, device="cpu", seed=7)
    assert handed.model is built.model  # the zygote's copy, not a second build
    fresh = load_workload("mlp", batch_size=3, device="cpu", seed=7)  # handed out once: built anew
    assert fresh.model is not built.model
    for a, b in zip(built.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(built.example_inputs[0], fresh.example_inputs[0])
    other_seed = prebuild_workload("mlp", batch_size=3, seed=8)
    assert load_workload("mlp", batch_size=3, device="cpu", seed=7).model is not other_seed.model
    assert load_workload("mlp", batch_size=3, device="cpu", seed=8).model is other_seed.model


def test_a_forked_worker_decides_inductors_compile_threads_from_its_own_environment(monkeypatch):
    """Inductor reads TORCHINDUCTOR_COMPILE_THREADS when it is imported, which happened in the zygote: a job
    that sets it (compile threads split between concurrent jobs) must get it as a fresh worker would."""
    from joulepilot.compiler.zygote_server import _fresh_compile_state
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    # restored afterwards by config.patch (pytest >= 9.1's monkeypatch.setattr would delete the key on undo)
    with config.patch(compile_threads=config.compile_threads):
        _fresh_compile_state()
        assert config.compile_threads == 3


def test_only_a_factory_for_a_gpu_is_left_to_each_worker_to_build():
    assert can_prebuild("mlp", "cpu") and can_prebuild("torchvision:resnet50", "cuda:0")
    assert can_prebuild("pkg.models:build", "cpu")
    assert not can_prebuild("pkg.models:build", "cuda:0")  # it may build on the device it is given


@pytest.mark.slow
def test_the_real_workers_zygote_preloads_the_compiler_and_the_measuring_code():
    from joulepilot.compiler import zygote_server

    info: dict = {}
    try:
        zygote_server.preload_modules(info)
    finally:
        torch.set_num_threads(info["threads"])  # preloading runs torch on one thread; this process keeps its own
    assert info["preloaded"][:2] == ["torch", "torch.compile"] and not info.get("preload_errors")
    assert set(zygote_server.PRELOAD_MODULES) <= set(info["preloaded"])
    assert {"torch._dynamo", "torch.export", "joulepilot.compiler.measure"} <= set(zygote_server.PRELOAD_MODULES)


@pytest.fixture
def one_fake_gpu(monkeypatch, fake_worker):
    """GPU 0 as the NVML fake lists it, here and in the processes this test starts (the model runs on the CPU)."""
    from fakes import fake_pynvml
    from fakes.fake_pynvml import FakeGpu

    gpu = [FakeGpu(uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444", power_w=100.0)]
    fake_pynvml.install_everywhere(monkeypatch, gpu)
    return gpu


def test_on_a_gpu_the_zygote_forks_the_eager_job_first_and_imports_the_compiler_while_it_runs(
        one_fake_gpu, own_tmpdir, live_children):
    budget = worker_budget(120, 0.2)
    with ZygotePool() as pool:
        eager = run_worker_job(_job("mlp", CompileConfig(mode="eager"), device="cuda:0"), budget=budget,
                               zygotes=pool)
        zygote = pool.current
        assert zygote.info["compiler"] == "deferred" and "torch.compile" not in zygote.info["preloaded"]
        log = (zygote.workdir / "stderr.txt").read_text()
        assert log.count("compiler preloaded") == 1 and "forking stops" not in log  # while the eager job ran
        compiled = run_worker_job(_job("mlp", CompileConfig(mode="default"), device="cuda:0"), budget=budget,
                                  zygotes=pool)
        assert pool.current is zygote  # the same zygote forked the compiled job, its compiler loaded
        assert (zygote.workdir / "stderr.txt").read_text().count("compiler preloaded") == 1
    assert [r["status"] for r in (eager, compiled)] == ["ok", "ok"], (eager, compiled)
    assert {r["worker_process"] for r in (eager, compiled)} == {FORKED}
    assert not live_children()


def test_on_a_gpu_the_first_compiled_job_describes_the_workload(one_fake_gpu, db, own_tmpdir, monkeypatch):
    from joulepilot.compiler.bench import describes_now

    eager, default = CompileConfig(mode="eager"), CompileConfig(mode="default")
    assert not describes_now("cuda:0", eager, True) and describes_now("cuda:0", default, True)
    assert describes_now("cuda:0", eager, False) and describes_now("cpu", eager, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # in this process only: the parent's checks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    runs = bench("mlp", [eager, default], device="cuda:0", min_seconds=0.2, db=db, idle_s=0)
    assert [r["status"] for r in runs] == ["ok", "ok"], [r["reason"] for r in runs]
    assert "describe" not in runs[0]["extra"] and "describe" in runs[1]["extra"]  # the eager job did not wait
    assert runs[0]["extra"]["worker_process"] == FORKED


def test_only_a_job_that_may_generate_cpu_code_gets_the_vector_instruction_programs():
    cpu = {"kind": "bench", "device": "cpu"}
    assert job_compiles_on_cpu({**cpu, "config": CompileConfig(mode="default").to_row()})
    assert job_compiles_on_cpu({**cpu, "kind": "warm_start", "config": CompileConfig(mode="default").to_row()})
    assert not job_compiles_on_cpu({**cpu, "config": CompileConfig(mode="eager").to_row()})
    assert job_compiles_on_cpu({**cpu, "kind": "doctor"}) and job_compiles_on_cpu({**cpu, "kind": "doctor",
                                                                                   "backend": "inductor"})
    assert not job_compiles_on_cpu({**cpu, "kind": "doctor", "backend": "eager"})
    assert not job_compiles_on_cpu({**cpu, "device": "cuda:0", "config": CompileConfig(mode="default").to_row()})


PICK_ISA = """
import json, os
from pathlib import Path
from torch._inductor import config
from torch._inductor.cpu_vec_isa import pick_vec_isa
isa = pick_vec_isa()
print(json.dumps({"isa": str(isa), "trusted": config.cpp.vec_isa_ok,
                  "binaries": sorted(str(p) for p in Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"))}))
"""


def test_with_the_cpus_flags_trusted_the_checks_inductor_still_builds_are_built_once_and_copied(tmp_path):
    """TORCHINDUCTOR_VEC_ISA_OK (set for the whole suite) skips Inductor's base test programs, not its BF16, VNNI
    and AMX ones: those are built once, in a folder of their own, and a fresh cache seeded from it builds none."""
    import json
    import subprocess
    import sys

    from joulepilot.compiler.host_isa import seed

    trusted = dict(os.environ, TORCHINDUCTOR_VEC_ISA_OK="1")
    untrusted = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    assert programs_dir(trusted) != programs_dir(untrusted)
    assert programs_dir(trusted).name.endswith("-vec-isa-ok-1")
    programs, stopped = ensure_programs(trusted)  # the suite's folder: built by whichever test came first
    assert programs is not None and stopped is None and not programs_to_build(trusted)
    built = sorted(p.relative_to(programs).as_posix() for p in programs.rglob("*.so"))
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        assert built  # what Inductor checks on this CPU with the flags trusted
    cache = tmp_path / "seeded"
    assert seed(cache, programs) >= len(built)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")}
    done = subprocess.run([sys.executable, "-c", PICK_ISA], capture_output=True, text=True, timeout=300,
                          env={**trusted, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-2000:]
    picked = json.loads(done.stdout.splitlines()[-1])
    assert picked["trusted"] is True and picked["isa"] == (programs.parent / "ready").read_text().strip()
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.so")} == before  # nothing built, nothing rebuilt


def test_building_the_vector_instruction_programs_stops_when_the_job_is_cancelled(monkeypatch, tmp_path):
    monkeypatch.setenv(PROGRAMS_DIR_ENV, str(tmp_path / "programs"))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    assert programs_to_build(env) and programs_to_build({**env, "TORCHINDUCTOR_VEC_ISA_OK": "1"})
    assert "once per host" in phase_text("bench", "vec_isa")  # what bench and the daemon show meanwhile
    started: list[float] = []

    def cancel() -> str | None:
        started.append(time.monotonic())
        return "the daemon is stopping"

    t0 = time.monotonic()
    assert ensure_programs(env, cancel) == (None, "the daemon is stopping")
    assert time.monotonic() - t0 < 5 and len(started) == 1  # killed at the first poll, not built
    assert not (programs_dir() / "ready").exists()

    def building_here(process: psutil.Process) -> bool:  # the build or a compiler it started, for this folder
        try:
            return str(tmp_path) in process.environ().get("TORCHINDUCTOR_CACHE_DIR", "")
        except (psutil.Error, OSError):
            return False

    assert not [p for p in psutil.process_iter() if p.pid != os.getpid() and building_here(p)]


def test_the_vector_instruction_build_dies_with_a_sigkilled_parent(tmp_path):
    """A SIGKILLed bench (or daemon) takes its build of the test programs along (PR_SET_PDEATHSIG), as it does its
    workers; the build used to run on for its ~10 s. The build is stopped (SIGSTOP) once it has imported torch, so
    that only the kernel's SIGKILL can end it, however long the build would take: one left stopped is a failure."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    env[PROGRAMS_DIR_ENV] = str(tmp_path / "programs")
    parent = subprocess.Popen([sys.executable, "-c", "import os\nfrom joulepilot.compiler.host_isa import "
                               "ensure_programs\nensure_programs(dict(os.environ))\n"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    build = None
    try:
        def torch_loaded() -> psutil.Process | None:
            for child in psutil.Process(parent.pid).children():
                try:
                    if any("libtorch" in m.path for m in child.memory_maps()):
                        return child
                except psutil.Error:
                    pass
            return None

        build = wait_for(torch_loaded, 120, "the build to import torch")
        build.suspend()
        parent.kill()
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs([build], timeout=60)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the build outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if build is not None and build.is_running():
            build.kill()


def test_on_a_cpu_a_compiled_job_loads_the_hosts_vector_instruction_programs_and_builds_only_its_kernel(
        monkeypatch, tmp_path):
    """Inductor checks the CPU's vector instruction sets by building and loading a test program per set in the
    cache folder it is given (conftest.py has it trust the CPU's flags instead; not here). The parent builds
    them once per host and torch version and copies them into each job's fresh cache: a compiled job loads
    them, as a deployed process does from its cache, and builds its model's one kernel alone, where it used to
    build every test program again (about 7 s of CPU here, counted in its compile_s)."""
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    # kept between runs of the suite, as the programs are between sweeps on a host
    monkeypatch.setenv(PROGRAMS_DIR_ENV, os.path.join(tempfile.gettempdir(), "joulepilot-test-vec-isa"))
    cache, stopped = ensure_programs(dict(os.environ))
    assert cache is not None and stopped is None and (programs_dir() / "ready").read_text().strip()  # what Inductor picked
    programs = {p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.suffix in KERNEL_SUFFIXES}
    assert programs
    old = 1_000_000_000.0  # 2001: a copy keeps it, a build would not
    for name in programs:
        os.utime(cache / name, (old, old))
    spec = "tests.workload_factories:pointwise"
    budget = worker_budget(600, 0.2)
    with ZygotePool() as pool:
        run = run_worker_job(_job(spec, CompileConfig(mode="default"), artifacts_path=str(tmp_path / "a.bin")),
                             budget=budget, zygotes=pool)
    assert run["status"] == "ok", run.get("reason")
    assert run["worker_process"] == FORKED
    with tarfile.open(kernels_path(Path(run["artifacts_path"]))) as packed:
        binaries = {m.name.removeprefix("inductor/"): m.mtime for m in packed.getmembers()
                    if Path(m.name).suffix in KERNEL_SUFFIXES}
    assert programs <= set(binaries) and all(binaries[name] == old for name in programs), binaries
    assert len(set(binaries) - programs) == 1  # the model's own kernel, built by this job


def test_a_second_configuration_compiles_cold_and_does_not_hit_the_first_ones_cache(db, own_tmpdir):
    """The same compiled configuration twice in one sweep (`force`): if the second worker could see the first
    one's Inductor cache (or in-process compiled state inherited from the zygote) it would record hits."""
    config = CompileConfig(mode="default")
    runs = bench("tests.workload_factories:linear", [config, config], device="cpu", min_seconds=0.2, db=db,
                 idle_s=0, force=True, save_artifacts=False)
    assert [r["status"] for r in runs] == ["ok", "ok"], [r["reason"] for r in runs]
    for run in runs:
        caches = run["extra"]["compile_caches"]
        assert run["extra"]["worker_process"] == FORKED
        assert caches.get("fxgraph_cache_miss", 0) >= 1, caches
        assert not caches.get("fxgraph_cache_hit") and not caches.get("autograd_cache_hit"), caches


def test_a_module_that_exits_at_import_fails_its_run_as_a_fresh_worker_would(db, tmp_path, fake_worker):
    """The zygote dies importing it; the job runs as a fresh process and fails with the worker's own reason, and the
    sweep stops there: the workload cannot be built, whatever the configuration."""
    (tmp_path / "hostile.py").write_text("import os, sys\nprint('refusing to load', file=sys.stderr)\n"
                                         "os._exit(7)\ndef build(batch_size=1):\n    pass\n")
    (run,) = bench(f"{tmp_path / 'hostile.py'}:build", [CompileConfig(mode="eager"), CompileConfig(mode="default")],
                   device="cpu", min_seconds=0.2, db=db, idle_s=0)
    assert run["status"] == "failed" and run["reason"].startswith("worker exited with code 7 during load")
    assert run["extra"]["worker_process"] == f"{FRESH} (the zygote exited with code 7 while preloading: refusing to load)"


def test_the_next_workloads_zygote_starts_while_the_current_one_measures_and_serves_its_first_job(
        flow_worker, own_tmpdir, live_children):
    budget = worker_budget(120, 0.2)
    with ZygotePool() as pool:
        first = run_worker_job(_job("mlp", CompileConfig(mode="eager")), budget=budget, zygotes=pool)
        current = pool.current
        assert not start_zygote_early(pool, worker_job_key("mlp", CompileConfig(mode="eager"), "cpu", None, None))
        assert start_zygote_early(pool, worker_job_key("mlp", CompileConfig(mode="eager"), "cpu", None, 7))
        nxt = pool.pending
        assert nxt is not None and nxt.early and pool.current is current  # beside the current one
        assert not start_zygote_early(pool, worker_job_key("mlp", CompileConfig(mode="eager"), "cpu", None, 9))
        same = run_worker_job(_job("mlp", CompileConfig(mode="default")), budget=budget, zygotes=pool)
        assert pool.current is current and pool.pending is nxt  # the current workload still has its zygote
        other = run_worker_job(_job("mlp", CompileConfig(mode="eager"), image_size=7), budget=budget, zygotes=pool)
        assert pool.current is nxt and pool.pending is None and current.proc.poll() is not None
    assert [r["status"] for r in (first, same, other)] == ["ok", "ok", "ok"], (first, same, other)
    assert [r["zygote_early"] for r in (first, same, other)] == [False, False, True]
    assert all(r["zygote_wait_s"] >= 0 for r in (first, same, other))
    assert not live_children()
