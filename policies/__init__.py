"""Policy files: schema and validation, resolution under limits, lock files."""

from .decide import Applicable, Decided, applicable_decision, decide, sync_lock
from .load import checked_policy, find_policy, load_policy, load_policy_folders, policy_dirs, policy_hash
from .lock import (
    LockFileError,
    LockWriteError,
    default_lock_dir,
    find_locked,
    lock_path,
    read_lock,
    write_lock,
)
from .resolve import (
    Candidate,
    Decision,
    break_even_text,
    candidate_configs,
    fallback_config,
    record_decision,
    resolve,
    stored_decision,
    torch_minor,
)
from .schema import OBJECTIVES, Policy, PolicyError, Problem, validate

__all__ = [
    "OBJECTIVES",
    "Applicable",
    "Decided",
    "LockFileError",
    "LockWriteError",
    "applicable_decision",
    "decide",
    "default_lock_dir",
    "find_locked",
    "sync_lock",
    "Candidate",
    "Decision",
    "Policy",
    "break_even_text",
    "PolicyError",
    "Problem",
    "candidate_configs",
    "fallback_config",
    "checked_policy",
    "find_policy",
    "load_policy",
    "load_policy_folders",
    "lock_path",
    "policy_dirs",
    "policy_hash",
    "read_lock",
    "record_decision",
    "resolve",
    "stored_decision",
    "torch_minor",
    "validate",
    "write_lock",
]
