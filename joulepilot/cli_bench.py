"""`joulepilot bench`: sweep one workload across compile configurations and store every run."""

from __future__ import annotations

import math
import sys
from typing import Any

import click

from .clikit import (
    SIZE,
    FiniteFloat,
    db_option,
    echo_json,
    echo_table,
    list_values,
    progress,
    sigterm_as_exit,
    text_value,
)

SUMMARY_COLUMNS = ("run_id", "config_label", "status", "compile_s", "warm_start_s", "latency_ms_p50",
                   "latency_ms_p95", "throughput_per_s", "energy_j_per_inference", "avg_power_w", "peak_power_w",
                   "max_rel_error", "energy_source")
SUMMARY_HEADERS = ("run", "config", "status", "compile s", "warm s", "p50 ms", "p95 ms", "samples/s", "J/inference",
                   "avg W", "peak W", "max rel err", "source")
# Left out in this order where the table would not fit; run, config, status, p50, J/inference and source stay.
SUMMARY_DROP_FIRST = ("warm_start_s", "peak_power_w", "latency_ms_p95", "max_rel_error", "throughput_per_s",
                      "avg_power_w", "compile_s")
# A generation's table (bench --task generate): per generated token, and its time to first token and per token.
GENERATION_COLUMNS = ("run_id", "config_label", "status", "compile_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p95",
                      "tokens_per_s", "energy_j_per_token", "avg_power_w", "peak_power_w", "tokens_match",
                      "max_rel_error", "energy_source")
GENERATION_HEADERS = ("run", "config", "status", "compile s", "TTFT ms", "TPOT ms", "TPOT p95 ms", "tokens/s",
                      "J/token", "avg W", "peak W", "tokens match", "max rel err", "source")


def _is_class_name(text: str) -> bool:
    from joulepilot.compiler.options import REGIONAL_AUTO, ConfigError, check_regional

    try:
        return check_regional(text) not in ("", REGIONAL_AUTO)
    except ConfigError:
        return False


def _energy_key(run: dict[str, Any]) -> tuple[int, float]:
    value = run.get("energy_j_per_inference")
    ok = run.get("status") == "ok" and value is not None and math.isfinite(value)
    return (0, value) if ok else (1, 0.0)


def _end_line(run: dict[str, Any]) -> tuple[str, str | None]:
    """A finished configuration's end line, and its window warning if any."""
    if run["status"] == "ok":
        warning = (run.get("extra") or {}).get("window_warning") if isinstance(run.get("extra"), dict) else None
        from joulepilot.store import compile_energy_text

        compile_j = compile_energy_text(run)
        compiled = f"ok, compile {run['compile_s']:.2f} s{', ' + compile_j if compile_j else ''}, "
        if run.get("energy_j_per_token") is not None:
            return compiled + _generation_figures(run), warning
        return (compiled + f"p50 {run['latency_ms_p50']:.3f} ms, "
                f"{run['energy_j_per_inference']:.4g} J/inference ({run['energy_source']})", warning)
    first_line = (run.get("reason") or "").splitlines()[0] if run.get("reason") else "unknown reason"
    return f"FAILED, {first_line}", None


def _generation_figures(run: dict[str, Any]) -> str:
    """A generation's end-line figures: 'TTFT 3.1 ms, TPOT 1.2 ms, 0.0151 J/token (estimate), tokens differ'."""
    ttft, tpot = run.get("ttft_ms_p50"), run.get("tpot_ms_p50")
    parts = [f"TTFT {ttft:.3g} ms" if ttft is not None else "", f"TPOT {tpot:.3g} ms" if tpot is not None else "",
             f"{run['energy_j_per_token']:.4g} J/token ({run['energy_source']})"]
    if run.get("tokens_match") == 0:
        parts.append(f"greedy tokens differ from eager {run.get('precision') or 'fp32'}'s")
    return ", ".join(p for p in parts if p)


def _bench_with_progress(configs: list[Any], *, parallel: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    """`bench` with one progress line per configuration on stderr: its phase and elapsed time while the
    worker runs, its result when done (and, over several GPUs, the GPU it ran on)."""
    from joulepilot.compiler import bench

    with progress(len(configs), "bench", noun="configuration", parallel=parallel) as report:
        def on_config(index: int, total: int, config: Any, run: dict[str, Any] | None) -> None:
            if run is not None and run.get("skipped"):  # `index` is already the 1-based number here
                report.start(index, config.label, "checking the store")
                report.finish(f"skipped, already measured ok as run {run['run_id']} under the same provenance "
                              "(--force measures it again)", index)
                return
            if run is None:
                report.start(index + 1, config.label, "compiling and measuring")
                return
            message, warning = _end_line(run)
            report.finish(message + (f" on {run.get('device')}" if parallel > 1 else ""), index)
            if warning:
                report.note(f"warning: {warning}", index)
            limit = (run.get("extra") or {}).get("recompile_warning") if isinstance(run.get("extra"), dict) else None
            if limit:
                report.note(f"warning: {limit}", index)

        def on_phase(index: int, total: int, config: Any, doing: str) -> None:
            report.phase(doing, index + 1)

        runs = bench(configs=configs, progress=on_config, phase_progress=on_phase, **kwargs)
        report.stopped_early = len(runs) < len(configs)
        return runs


def _echo_graph_breaks(runs: list[dict[str, Any]], spec: str, batch_size: int, seq_len: int | None,
                       image_size: int | None) -> None:
    """One line per distinct set of graph breaks among the runs, naming the configurations that have it."""
    from joulepilot.compiler.graph_breaks import doctor_command, graph_break_notes, note_line

    command = doctor_command(spec, batch_size, seq_len, image_size)
    for note in graph_break_notes([r for r in runs if r.get("status") == "ok"], command):
        click.echo(f"graph breaks in {note_line(note)}")


def _yes_no(flag: Any) -> str | None:
    return None if flag is None else "yes" if flag else "no"


def _notice(text: str) -> None:
    click.echo(f"bench: {text}", err=True)


@click.command("bench")
@click.argument("spec")
@click.option("--batch-size", type=SIZE, default=1, show_default=True,
              help="Samples per forward call.")
@click.option("--modes", "--mode", "modes", multiple=True, callback=list_values("eager,default"),
              help="Compile modes, comma list or repeated: eager, default, reduce-overhead, "
                   "max-autotune-no-cudagraphs, max-autotune. Default: eager,default on CPU; "
                   "eager,default,reduce-overhead,max-autotune-no-cudagraphs on a GPU.")
@click.option("--fusion", "fusions", multiple=True, callback=list_values("default,aggressive-fusion"),
              help="Inductor fusion presets, comma list or repeated (default: default).")
@click.option("--precision", "precisions", multiple=True, callback=list_values("fp32,bf16"),
              help="fp32, tf32, bf16, fp16; comma list or repeated. Default: fp32 on CPU, fp32,bf16 on a GPU.")
@click.option("--option", "raw_options", multiple=True, metavar="NAME=VALUE", callback=text_value,
              help="Raw Inductor option for every compiled configuration, e.g. max_fusion_size=32.")
@click.option("--dynamic", is_flag=True, help="Compile with dynamic shapes.")
@click.option("--regional", is_flag=True,
              help="Also measure each compiled configuration with regional compilation: the model's most "
                   "repeated block class compiled instance by instance instead of the whole model.")
@click.option("--regional-block", metavar="CLASS", callback=text_value,
              help="The block class regional compilation compiles (e.g. BertLayer); implies --regional.")
@click.option("--task", type=click.Choice(["forward", "generate"]), default="forward", show_default=True,
              help="forward: J per forward call of one batch; generate: a prompt, then new tokens against a KV "
                   "cache (J per generated token, TTFT, TPOT) for a causal LM (tiny-llama, transformers:LlamaConfig, "
                   "...).")
@click.option("--prompt-len", type=SIZE, help="--task generate: prompt tokens per sequence (default 128).")
@click.option("--new-tokens", type=SIZE, help="--task generate: tokens every sequence generates (default 128).")
@click.option("--model-option", "model_option_items", multiple=True, metavar="NAME=VALUE", callback=text_value,
              help="Override an attribute of a transformers config (or tiny-llama's), e.g. num_hidden_layers=2; "
                   "repeatable.")
@click.option("--cache", "caches", multiple=True, callback=list_values("dynamic,static"),
              help="--task generate: KV caches, dynamic and/or static (default: eager with the dynamic cache, "
                   "compiled modes with the static one).")
@click.option("--compile-prefill", is_flag=True,
              help="--task generate: also measure each compiled configuration with the prompt's forward pass "
                   "compiled (by default only decode steps run compiled).")
@click.option("--seq-len", type=SIZE, help="Sequence length for token workloads.")
@click.option("--image-size", type=SIZE, help="Image side for vision workloads.")
@click.option("--shapes", metavar="DIM=SIZE[:WEIGHT],...", callback=text_value,
              help="Measure over a shape set, e.g. seq_len=64:4,128:3,256:2,512:1: J per call weighted by the "
                   "sizes' shares, recompiles counted over them; compiled modes are swept static and dynamic "
                   "(--dynamic: dynamic only), unpadded and padded to buckets.")
@click.option("--buckets", metavar="SIZE,...", callback=text_value,
              help="Padding buckets for --shapes (default: powers of two).")
@click.option("--min-seconds", type=FiniteFloat(min=0.05),
              help="Length of each energy window (default 5 on a GPU, 2 on CPU).")
@click.option("--budget-s", type=FiniteFloat(min=1), default=600, show_default=True,
              help="Budget of each configuration's first forward calls (eager reference + cold compile); the "
                   "worker's other phases get an allowance derived from --min-seconds (README: budget model). "
                   "An overrun is recorded as a failed run.")
@click.option("--device", callback=text_value, help="cuda:N or cpu (default: cuda:0 when available, else cpu).")
@click.option("--devices", metavar="0,1", callback=list_values("0,1"),
              help="Several GPUs, e.g. 0,1 or cuda:0,cuda:1: as many configurations at once, one per GPU, each "
                   "metered on its own GPU; compile threads are split between them. Instead of --device.")
@click.option("--force", is_flag=True,
              help="Measure every configuration again, even those already measured ok under the same provenance.")
@click.option("--threads", type=click.IntRange(min=1, max=4096),
              help="torch's intra-op threads for a CPU measurement (default: OMP_NUM_THREADS, else the cores this "
                   "process may run on).")
@click.option("--warm-start/--no-warm-start", default=None,
              help="Also time a fresh process that loads the saved compile artifacts (default: on for GPUs).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON (progress stays on stderr).")
def bench_command(spec: str, batch_size: int, modes: list[str] | None, fusions: list[str] | None,
                  precisions: list[str] | None, raw_options: tuple[str, ...], dynamic: bool, regional: bool,
                  regional_block: str | None, task: str, prompt_len: int | None, new_tokens: int | None,
                  model_option_items: tuple[str, ...], caches: list[str] | None, compile_prefill: bool,
                  seq_len: int | None,
                  image_size: int | None, shapes: str | None, buckets: str | None, min_seconds: float | None,
                  budget_s: float, device: str | None, devices: list[str] | None, force: bool, threads: int | None,
                  warm_start: bool | None, db: str | None, as_json: bool) -> None:
    """Benchmark SPEC under compile configurations; store each run and print them by joules per inference.

    SPEC is mlp, convnet, transformer, torchvision:<name>, timm:<name>, transformers:<ConfigClass> or
    package.module:factory; with --task generate, tiny-llama, a causal LM's transformers:<ConfigClass> or a
    factory returning (model, input_ids).
    """
    from joulepilot.compiler import (
        ConfigError,
        WorkloadError,
        check_device,
        check_spec,
        default_device,
        plan_configs,
    )
    from joulepilot.compiler.bench import (
        check_devices,
        default_modes,
        default_precisions,
        remove_stale_scratch,
    )
    from joulepilot.compiler.generation_workloads import (
        generation_of,
        parse_model_options,
        plan_generation_configs,
    )
    from joulepilot.compiler.options import parse_option_assignments
    from joulepilot.compiler.shape_set import parse_shape_set, shape_set_variants
    from joulepilot.store import StoreError
    from joulepilot.telemetry import TelemetryError

    remove_stale_scratch(_notice)  # what a killed bench left, even when this one is refused
    try:  # first: the check reads no torch, which the rest imports (seconds), so a typo is refused at once
        check_spec(spec)
    except WorkloadError as exc:
        raise click.ClickException(str(exc)) from exc
    if regional_block is not None and not _is_class_name(regional_block):
        raise click.ClickException(f"--regional-block {regional_block!r} is not a class name: give the block class "
                                   "to compile, e.g. --regional-block EncoderLayer (or --regional for the most "
                                   "repeated one)")
    try:
        if devices is not None and device is not None:
            raise ConfigError("give either --device or --devices, not both")
        devices = check_devices(devices) if devices is not None else None
        device = devices[0] if devices else check_device(device or default_device())
        if threads is not None and device != "cpu":
            raise ConfigError(f"--threads sets torch's threads for a measurement on the CPU; drop it for {device}")
        generation = generation_of(task, prompt_len, new_tokens, caches or (), compile_prefill)
        if generation is not None and (regional or regional_block):
            raise ConfigError("--regional compiles a forward pass's repeated blocks, which is not measured for a "
                              "generation yet: drop --regional")
        model_options = parse_model_options(model_option_items)
        plan_args = (modes or default_modes(device), fusions or ["default"], precisions or default_precisions(device))
        if generation is not None:
            configs = plan_generation_configs(*plan_args, batch_size=batch_size, dynamic=dynamic,
                                              options=parse_option_assignments(raw_options),
                                              caches=caches or (), compile_prefill=(False, compile_prefill))
        else:
            configs = plan_configs(
                *plan_args, batch_size=batch_size, dynamic=dynamic, options=parse_option_assignments(raw_options),
                regional=("", regional_block or "auto") if regional or regional_block else ("",),
            )
        shape_set = None
        if buckets and not shapes:
            raise ConfigError("--buckets pads the sizes of a shape set: give --shapes too")
        if shapes:
            shape_set = parse_shape_set(shapes, buckets)
            if {"seq_len": seq_len, "image_size": image_size}[shape_set.dim] is not None:
                raise ConfigError(f"--shapes gives the {shape_set.dim} sizes: drop --{shape_set.dim.replace('_', '-')}")
            configs = shape_set_variants(configs, shape_set, (True,) if dynamic else (False, True))
        with sigterm_as_exit():
            runs = _bench_with_progress(configs, parallel=len(devices or [device]), spec=spec, device=device,
                                        devices=devices, min_seconds=min_seconds,
                                        budget_s=budget_s, db=db, batch_size=batch_size, seq_len=seq_len,
                                        image_size=image_size, shapes=shape_set, warm_start=warm_start, force=force,
                                        threads=threads, model_options=model_options, generation=generation,
                                        notice=_notice)
    except (ConfigError, WorkloadError) as exc:
        raise click.ClickException(str(exc)) from exc
    except (StoreError, TelemetryError) as exc:
        raise click.ClickException(f"{exc}") from exc
    runs.sort(key=_energy_key)
    if as_json:
        echo_json(runs)
    elif generation is not None:
        echo_table([{**r, "tokens_match": _yes_no(r.get("tokens_match"))} for r in runs], GENERATION_COLUMNS,
                   GENERATION_HEADERS)
    else:
        echo_table(runs, SUMMARY_COLUMNS, SUMMARY_HEADERS, drop_first=SUMMARY_DROP_FIRST)
    if not as_json:
        failed = [r for r in runs if r["status"] != "ok"]
        for run in failed:
            click.echo(f"run {run['run_id']} ({run['config_label']}) failed: {run.get('reason')}")
        skipped = [r for r in runs if r.get("skipped")]
        if skipped:
            click.echo(f"{len(skipped)} configuration(s) already measured ok under the same provenance were not "
                       "measured again (runs " + ", ".join(str(r["run_id"]) for r in skipped) + "); --force redoes them")
        if generation is None:  # doctor analyses a forward pass; a generation's breaks are in extra.graph_breaks
            _echo_graph_breaks(runs, spec, batch_size, seq_len, image_size)
        if any(r.get("energy_source") == "estimate" for r in runs):
            click.echo("source 'estimate': CPU time x watts per core, not a measurement (no RAPL or NVML here).")
    not_stored = [r for r in runs if r.get("pending_path")]
    for run in not_stored:
        click.echo(f"{run['config_label']}: its run was NOT stored: {run.get('store_error') or 'the commit failed'}; "
                   f"it is kept in {run['pending_path']} and imported the next time bench or the daemon opens the "
                   "database", err=True)
    if not_stored or (runs and all(r["status"] != "ok" for r in runs)):
        sys.exit(1)


commands = [bench_command]
