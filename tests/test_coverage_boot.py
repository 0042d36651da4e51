"""The suite's coverage boot (tests/coverage_boot/sitecustomize.py) pauses coverage's tracer while torch imports
and while Dynamo compiles, and must start it again afterwards: joulepilot code that runs after a compile is
still measured, and the compile's result is what it would be without the boot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BOOT = Path(__file__).parent / "coverage_boot"

SCRIPT = """
import inspect, json, sys
import coverage

measuring = coverage.Coverage(source_pkgs=["joulepilot"], data_file=sys.argv[1])
measuring.start()
import torch
after_import = type(sys.gettrace()).__name__
from joulepilot.compiler.config import CompileConfig

inside = []

def backend(graph_module, example_inputs):
    inside.append(repr(sys.gettrace()))
    return graph_module.forward

def double_then_relu(x):
    return torch.relu(x * 2)

x = torch.randn(4, 4)
same = bool(torch.equal(torch.compile(double_then_relu, backend=backend)(x), double_then_relu(x)))
after_compile = type(sys.gettrace()).__name__
label = CompileConfig("default").label  # runs only now, after the compile
measuring.stop()
lines, start = inspect.getsourcelines(CompileConfig.label.fget)
body = set(range(start + 1, start + len(lines)))
measured = set(measuring.get_data().lines(inspect.getsourcefile(CompileConfig)) or ())
print(json.dumps({"after_import": after_import, "inside": inside, "same": same, "after_compile": after_compile,
                  "label_lines_measured": sorted(body & measured)}))
"""


def test_the_tracer_is_off_inside_a_compile_and_back_after_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_PROCESS_")}  # only this script's
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT), str(BOOT.parent.parent)])
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / ".coverage")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == "CTracer"  # resumed once torch had imported
    assert seen["inside"] == ["None"]  # one graph, compiled with no tracer in this thread
    assert seen["same"] is True
    assert seen["after_compile"] == "CTracer"
    assert seen["label_lines_measured"]  # joulepilot code run after the compile is measured
