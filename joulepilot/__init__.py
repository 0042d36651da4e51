"""joulepilot: energy-aware torch.compile policy controller.

`joulepilot.compile(model, policy=...)` applies the decided compile settings (`joulepilot.runtime`);
`joulepilot.EnergyMeter` measures windows of energy. Both are imported lazily so `import joulepilot`
stays light, and serving a model imports nothing of the agent (`joulepilot.controller`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["EnergyMeter", "compile", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "compile":
        from .runtime import compile

        return compile
    if name == "EnergyMeter":
        from .telemetry import EnergyMeter

        return EnergyMeter
    raise AttributeError(f"module 'joulepilot' has no attribute {name!r}")
