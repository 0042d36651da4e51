"""The parent of a sweep (`bench`, the daemon) stays light: on a CPU it never imports torch, whose import
takes seconds that every sweep would pay before its first measurement."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from joulepilot.compiler.provenance import provenance, torch_versions


def test_torch_versions_are_torchs_own():
    assert torch_versions() == (str(torch.__version__), torch.version.cuda)


def test_provenance_is_taken_without_importing_torch():
    code = textwrap.dedent("""
        import json, sys
        from joulepilot.compiler.provenance import provenance
        fields = provenance("cpu")
        print(json.dumps({"torch_loaded": "torch" in sys.modules, "torch_version": fields["torch_version"],
                          "cuda_version": fields["cuda_version"], "key": fields["provenance_key"]}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    import json

    seen = json.loads(out.stdout)
    assert seen["torch_loaded"] is False
    here = provenance("cpu")  # torch is loaded in this process: asked of torch itself
    assert (seen["torch_version"], seen["cuda_version"]) == (here["torch_version"], here["cuda_version"])
    assert seen["key"] == here["provenance_key"]  # runs stored before this change still count as measured


def test_a_cpu_sweep_never_imports_torch_in_its_parent(tmp_path, flow_worker):
    code = textwrap.dedent(f"""
        import sys
        from joulepilot.compiler import CompileConfig, bench
        (run,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, idle_s=0.2,
                       db={str(tmp_path / "s.db")!r})
        assert run["status"] == "ok", run
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
