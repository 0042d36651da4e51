"""`import pynvml` in a process a test started, with this folder first on PYTHONPATH: the NVML fake
(tests/fakes/fake_pynvml.py) simulating the GPUs that JOULEPILOT_FAKE_GPUS describes. Set up by
`fake_pynvml.subprocess_env`; the repository root must be importable (the `fake_worker` fixture puts it on
PYTHONPATH)."""

import sys

from tests.fakes import fake_pynvml

fake_pynvml.install_from_env()
sys.modules[__name__] = fake_pynvml  # `import pynvml` returns what sys.modules holds once this has run
