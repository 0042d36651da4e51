"""joulepilot: energy-aware torch.compile policy controller."""

__version__ = "0.1.0"
