"""The compiler core: configuration space, workloads, the isolated benchmark worker, warm-start artifacts."""

from .apply import apply_config
from .artifacts import (
    ArtifactsInfo,
    artifact_key,
    artifact_path_for,
    load_artifacts,
    load_warm_start,
    save_artifacts,
    save_warm_start,
)
from .bench import (
    MeasuredRun,
    RunResult,
    SweepContext,
    bench,
    check_device,
    default_device,
    measure_config,
    plan_configs,
    sweep_context,
    time_warm_start,
    warm_start_fields,
    worker_job_key,
)
from .budget import WorkerBudget, worker_budget
from .config import CompileConfig
from .describe import count_flops, describe_workload
from .doctor import DoctorError, analyse_model, doctor
from .generation import GenerationError, PreparedGeneration, prepare_generation
from .generation_workloads import Generation, plan_generation_configs
from .inductor import checked_config, torch_compile_kwargs
from .numerics import max_rel_error
from .options import FUSION_PRESETS, MODES, PADDINGS, PRECISIONS, REGIONAL_AUTO, ConfigError
from .regional import BlockClass, RegionalError, block_classes, choose_block, compile_blocks
from .runner import start_zygote_early
from .shape_set import ShapeSet
from .workloads import Workload, WorkloadError, check_spec, load_workload, workload_id
from .zygote import ZygotePool

__all__ = [
    "FUSION_PRESETS",
    "MODES",
    "PADDINGS",
    "PRECISIONS",
    "REGIONAL_AUTO",
    "ArtifactsInfo",
    "BlockClass",
    "RegionalError",
    "CompileConfig",
    "ConfigError",
    "DoctorError",
    "Generation",
    "GenerationError",
    "PreparedGeneration",
    "MeasuredRun",
    "ShapeSet",
    "SweepContext",
    "WorkerBudget",
    "RunResult",
    "Workload",
    "WorkloadError",
    "analyse_model",
    "apply_config",
    "artifact_key",
    "artifact_path_for",
    "bench",
    "block_classes",
    "choose_block",
    "compile_blocks",
    "check_device",
    "check_spec",
    "checked_config",
    "count_flops",
    "default_device",
    "describe_workload",
    "doctor",
    "load_artifacts",
    "load_warm_start",
    "load_workload",
    "max_rel_error",
    "measure_config",
    "plan_configs",
    "plan_generation_configs",
    "prepare_generation",
    "save_artifacts",
    "save_warm_start",
    "start_zygote_early",
    "sweep_context",
    "time_warm_start",
    "torch_compile_kwargs",
    "warm_start_fields",
    "worker_budget",
    "worker_job_key",
    "workload_id",
    "ZygotePool",
]
