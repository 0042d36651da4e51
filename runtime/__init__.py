"""Serving: the decision in force and how it is applied (the hook), live metering, the envelope guard.

What a process that serves a model imports. It reads policies, lock files and the store, applies
configurations through the compiler and meters through telemetry; it imports nothing of the agent
(`joulepilot.controller`), scikit-learn, matplotlib, prometheus_client or schedule, and installs no
signal handler unless asked (`flush_on_sigterm`).
"""

from .attach import attach
from .guard import EnvelopeGuard, EnvelopeWarning, Trip, guard_from_policy
from .hook import compile, merge_compile_kwargs
from .lookup import AppliedDecision, current_device_kind, lookup_decision, torch_version_minor
from .metered import Fallback, MeteredModel, close_all, flush_on_sigterm
from .served import ServedModel
from .trips import record_trip

__all__ = [
    "AppliedDecision",
    "EnvelopeGuard",
    "EnvelopeWarning",
    "Fallback",
    "MeteredModel",
    "ServedModel",
    "Trip",
    "attach",
    "close_all",
    "compile",
    "current_device_kind",
    "flush_on_sigterm",
    "guard_from_policy",
    "lookup_decision",
    "merge_compile_kwargs",
    "record_trip",
    "torch_version_minor",
]
