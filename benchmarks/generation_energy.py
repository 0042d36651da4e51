"""Joules per generated token: two random-weight causal LMs of about 0.5-1.5 B parameters, eager against compiled.

    python benchmarks/generation_energy.py --out benchmarks/results/generation/h100 --max-minutes 9
    python benchmarks/generation_energy.py --out OUT --models qwen2 --batches 32 --configs eager,reduce-overhead \\
        --device cuda:1 --max-minutes 9        # a part of the table, on the second GPU, into its own OUT
    python benchmarks/generation_energy.py --models tiny --batches 1 --configs eager --precisions fp32 \\
        --prompt-len 8 --new-tokens 4 --device cpu --min-seconds 0.2 --out /tmp/smoke   # runs anywhere

Per model and batch (prompt 512 tokens, 256 new tokens, batch 1, 8 and 32 by default), in each precision
(bf16 and fp16 as the model's dtype), `bench --task generate` measures, in this order so a deadline cuts the
least informative last:
- `eager`: eager with the dynamic KV cache, as transformers generates by default (the baseline);
- `transformers-static-compile`: the reference to beat, transformers' own recipe and nothing of joulepilot's: the
  same model and prompts (the same seed), cast to the precision, generating with `cache_implementation="static"`
  and transformers' automatic compile of decode steps (its default `CompileConfig`: reduce-overhead,
  `dynamic=None`, `fullgraph=False`, compiling `model.__call__`; the prompt uncompiled). joulepilot applies an
  eager configuration to it (nothing compiled), and the model's `generate` hands transformers its own settings
  (`transformers_recipe_*` below), measured by the same worker, meters and windows as every other row; off CUDA
  transformers skips its compile (the row is then eager with the static cache);
- `default`, `reduce-overhead`, `max-autotune-no-cudagraphs`, `max-autotune`: the forward compiled by joulepilot under
  that mode with the static KV cache, decode steps compiled, the prompt eager (reduce-overhead with these settings is
  transformers' recipe as joulepilot compiles it: the forward with `dynamic=False`, see README "Generation");
- `compiled-dynamic-cache`: the forward compiled (default mode, dynamic shapes) with the dynamic cache: what
  `torch.compile(model)` gives a generation without a static cache.

Whether joulepilot's reduce-overhead static-cache row is slower per step than transformers' own compile (the first
H200 run: 2.98 ms per token against the 2.4 ms another script measured). On the CPU (tests/test_generation_bench.py)
a decode step hands the compiler the same FX graph on inputs of the same shapes, with the same guards, one graph
and no recompile over repeated calls in both, and the dispatcher adds no measurable time per step; the one
difference found and removed was a static cache one position longer than transformers'. On the GPU the two rows
measured side by side (H200, session 15) took 0.506 against 0.557 J/token (llama) and 0.535 against 0.534 (qwen2),
TPOT 2.34 against 2.69 ms and 2.38 against 2.40 ms: the gaps of single runs in either direction are within the
5-15% that one configuration's runs spread over, so `dynamic=False` against transformers' `dynamic=None` made no
difference that the runs can show.

Every finished run is in the database (`--db`, default OUT/generation.db) and appended to OUT/runs.jsonl the
moment it finishes, so a call that is cut off loses only the run in progress; the same command again skips
what is measured (`bench`'s rule) and goes on. `--max-minutes` stops starting runs when fewer than
`--reserve-s` seconds would remain. At the end the runs are exported as a `joulepilot runs export` file
(OUT/runs_export.json: `joulepilot runs import` reads it, and it is the shape of tests/data/) and the J/token
table is written to OUT/summary.md and printed. Split the table over calls and GPUs with `--models`,
`--batches`, `--configs` and `--device` (a separate OUT per GPU, or one database per call and `joulepilot runs
import` to join them).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from joulepilot.compiler import CompileConfig, bench
from joulepilot.compiler.generation_workloads import Generation, transformers_config
from joulepilot.store import export_runs, list_runs, open_db, write_export
from sweep_log import SweepLog, log

# Two architectures transformers builds from config, of about 0.5-1.5 B parameters (counted at start).
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"spec": "transformers:LlamaConfig",
              "options": {"hidden_size": 1536, "intermediate_size": 8192, "num_hidden_layers": 16,
                          "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}},
    "qwen2": {"spec": "transformers:Qwen2Config",
              "options": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 16,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                          "tie_word_embeddings": True}},
    "tiny": {"spec": "tiny-llama", "options": {}},  # the smoke test's
}
DEFAULT_MODELS = "llama,qwen2"
RECIPE = "transformers-static-compile"
CONFIGS = ("eager", RECIPE, "default", "reduce-overhead", "max-autotune-no-cudagraphs", "compiled-dynamic-cache",
           "max-autotune")
RECIPE_LABEL = "transformers static-cache compile"


def recipe_spec(name: str) -> str:
    """The factory spec of transformers' recipe for model `name` (this file's `transformers_recipe_<name>`)."""
    return f"{Path(__file__).resolve()}:transformers_recipe_{name}"


def _recipe(name: str, batch_size: int, prompt_len: int, new_tokens: int, device: str) -> tuple[Any, Any]:
    """Model `name` and its prompts exactly as `bench` builds its spec with its options (the worker seeded torch
    with the workload's seed before calling the factory, and the prompts come from a generator of that seed),
    whose `generate`, once joulepilot has prepared it (`_joulepilot_generation`, after the eager fp32 reference),
    generates as transformers' recipe does: the static cache and transformers' automatic compile with its own
    default settings, whatever joulepilot's eager configuration set."""
    import torch
    from joulepilot.compiler.generation_workloads import build_generation
    from joulepilot.compiler.workloads import DEFAULT_SEED

    model = MODELS[name]
    built, (input_ids,), _ = build_generation(model["spec"], batch_size, Generation(prompt_len, new_tokens),
                                              model["options"] or None, device,
                                              torch.Generator().manual_seed(DEFAULT_SEED))
    base = type(built)

    def generate(self: Any, *args: Any, generation_config: Any = None, **kwargs: Any) -> Any:
        if getattr(self, "_joulepilot_generation", None) is not None:
            settings = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
            settings.cache_implementation = "static"
            settings.disable_compile = False
            settings.compile_config = None  # transformers' default CompileConfig
            generation_config = settings
        return base.generate(self, *args, generation_config=generation_config, **kwargs)

    built.__class__ = type(f"TransformersRecipe{base.__name__}", (base,), {"generate": generate})
    return built, input_ids


def transformers_recipe_llama(batch_size: int, prompt_len: int, new_tokens: int, device: str) -> tuple[Any, Any]:
    return _recipe("llama", batch_size, prompt_len, new_tokens, device)


def transformers_recipe_qwen2(batch_size: int, prompt_len: int, new_tokens: int, device: str) -> tuple[Any, Any]:
    return _recipe("qwen2", batch_size, prompt_len, new_tokens, device)


def transformers_recipe_tiny(batch_size: int, prompt_len: int, new_tokens: int, device: str) -> tuple[Any, Any]:
    return _recipe("tiny", batch_size, prompt_len, new_tokens, device)


def _recipe_progress(progress: Any) -> Any:
    """`progress` naming transformers' recipe rather than the eager configuration joulepilot measures it as."""
    class Named:
        def __init__(self, config: CompileConfig) -> None:
            self.label = f"{RECIPE_LABEL}/{config.precision}/b{config.batch_size}"

    return lambda index, total, config, run: progress(index, total, Named(config), run)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def config_of(name: str, precision: str, batch_size: int) -> CompileConfig:
    """One of CONFIGS in `precision` at `batch_size` (transformers' recipe: the eager configuration joulepilot applies
    to its model, which compiles itself)."""
    if name in ("eager", RECIPE):
        return CompileConfig("eager", precision=precision, batch_size=batch_size)
    if name == "compiled-dynamic-cache":
        return CompileConfig("default", precision=precision, dynamic=True, batch_size=batch_size)
    return CompileConfig(name, precision=precision, cache="static", batch_size=batch_size)


def plan(names: list[str], precisions: list[str], batch_size: int) -> list[CompileConfig]:
    """Every configuration of joulepilot's named, in CONFIGS order, in each precision (precisions inside
    configurations, so that a deadline leaves every precision its most informative runs); transformers' recipe
    is measured apart (`plan_recipe`)."""
    return [config_of(name, precision, batch_size) for name in CONFIGS if name in names and name != RECIPE
            for precision in precisions]


def plan_recipe(names: list[str], precisions: list[str], batch_size: int) -> list[CompileConfig]:
    """transformers' recipe in each precision, when named."""
    return [config_of(RECIPE, precision, batch_size) for precision in precisions] if RECIPE in names else []


def param_count(spec: str, options: dict[str, Any]) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers_config(spec, options))
    return sum(p.numel() for p in model.parameters())


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _model_name(run: dict[str, Any]) -> str:
    options = json.loads(run["model_options"]) if isinstance(run.get("model_options"), str) else \
        (run.get("model_options") or {})
    for name, model in MODELS.items():
        if (model["spec"] == run["workload"] and model["options"] == options) or run["workload"] == recipe_spec(name) \
                or str(run["workload"]).endswith(f":transformers_recipe_{name}"):
            return name
    return run["workload"]


def _is_recipe(run: dict[str, Any]) -> bool:
    return ":transformers_recipe_" in str(run.get("workload"))


def _kind_of_label(label: str) -> str:
    """What a table label is: eager, transformers' recipe, '<mode> static' or the compiled dynamic cache."""
    if label.startswith(RECIPE_LABEL):
        return RECIPE
    mode = label.split("/")[0]
    if mode == "eager":
        return "eager"
    return f"{mode} static" if "/static-cache/" in label else "compiled-dynamic-cache"


def _median_of_kind(by_label: dict[str, list[float]], kind: str) -> tuple[float | None, str]:
    """(the median J/token of the configuration of `kind` among `by_label`'s, its runs in brackets when more than
    one), or (None, '')."""
    found = [label for label in by_label if _kind_of_label(label) == kind]
    return (statistics.median(by_label[found[0]]), _runs_text(by_label[found[0]])) if found else (None, "")


def _runs_text(values: list[float]) -> str:
    return f" ({len(values)})" if len(values) > 1 else ""


def _label(run: dict[str, Any]) -> str:
    """A run's configuration as the table names it (transformers' recipe by name: joulepilot applied eager to it)."""
    return f"{RECIPE_LABEL}/{run['precision']}/b{run['batch_size']}" if _is_recipe(run) else run["config_label"]


def params_text(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count / 1e6:.2f} M"


def _saving(value: float | None, against: float | None) -> str:
    if value is None or not against:
        return "-"
    return f"{(1 - value / against) * 100:.0f} %"


def summary_table(runs: list[dict[str, Any]], params: dict[str, int]) -> str:
    """The J/token table, per model and batch: every run, then the lowest J/token of a static-cache configuration
    of joulepilot's against eager, against the compiled forward with the dynamic cache and against transformers'
    own static-cache compile, in the same precision."""
    runs = [r for r in runs if r.get("task") == "generate"]
    sources = sorted({r["energy_source"] for r in runs if r.get("energy_source")})
    device = next((r["device_name"] for r in runs if r.get("device_name")), "?")
    torch_version = next((r["torch_version"] for r in runs if r.get("torch_version")), "?")
    shape = next(((r["prompt_len"], r["new_tokens"]) for r in runs), (None, None))
    lines = [f"Device: {device}; torch {torch_version}; prompt {shape[0]} tokens, {shape[1]} new tokens per sequence; "
             f"energy source: {', '.join(sources) or '-'}"
             + (" (an estimate, not a measurement)" if sources == ["estimate"] else ""), "",
             "J/token: prefill and decode of the whole batch over every generated token (a row per run). Tokens "
             "match: the greedy tokens equal eager's in the same precision and cache for every new token ('-' for "
             "transformers' recipe, which compiles itself inside a configuration joulepilot measures as eager, so "
             "it is not checked).", "",
             "| model | batch | config | J/token | TTFT ms | TPOT ms | TPOT p95 ms | tokens/s | avg W | peak W | "
             "compile s | tokens match | max rel err | status |", "|" + "---|" * 14]
    key = lambda r: (_model_name(r), r["batch_size"], r["precision"], r["status"] != "ok",  # noqa: E731
                     r.get("energy_j_per_token") or 0)
    for r in sorted(runs, key=key):
        status = r["status"] if r["status"] == "ok" else f"failed: {(r.get('reason') or '').splitlines()[0][:80]}"
        # transformers' recipe is measured as an eager configuration, its own reference: its tokens were not checked
        match = None if r.get("tokens_match") is None or _is_recipe(r) else "yes" if r["tokens_match"] else "no"
        name = _model_name(r)
        lines.append(f"| {name} ({params_text(params.get(name, 0))}) | {r['batch_size']} | {_label(r)} | "
                     f"{_fmt(r.get('energy_j_per_token'))} | {_fmt(r.get('ttft_ms_p50'))} | "
                     f"{_fmt(r.get('tpot_ms_p50'))} | {_fmt(r.get('tpot_ms_p95'))} | {_fmt(r.get('tokens_per_s'))} | "
                     f"{_fmt(r.get('avg_power_w'))} | {_fmt(r.get('peak_power_w'))} | {_fmt(r.get('compile_s'))} | "
                     f"{_fmt(match)} | {_fmt(r.get('max_rel_error'), 2)} | {status} |")
    lines += ["", "Lowest J/token of a static-cache configuration per model, batch and precision, each configuration by "
              "the median of its runs (runs in brackets where more than one; a gap smaller than the runs' spread is "
              "not a ranking):", "",
              "| model | batch | precision | eager J/token | compiled, dynamic cache J/token | transformers' static-cache "
              "compile J/token | lowest static-cache J/token | its config | saving vs eager | saving vs compiled "
              "dynamic cache | saving vs transformers' compile |", "|" + "---|" * 11]
    groups: dict[tuple[str, int, str], dict[str, list[float]]] = {}
    for r in runs:
        if r["status"] == "ok" and r.get("energy_j_per_token") is not None:
            by_label = groups.setdefault((_model_name(r), r["batch_size"], r["precision"]), {})
            by_label.setdefault(_label(r), []).append(r["energy_j_per_token"])
    for (name, batch, precision), by_label in sorted(groups.items()):
        medians = {label: statistics.median(values) for label, values in by_label.items()}
        of = functools.partial(_median_of_kind, by_label)
        static = {label: value for label, value in medians.items() if _kind_of_label(label).endswith(" static")}
        best = min(static, key=static.__getitem__) if static else None
        chosen = static[best] if best else None
        (eager, eager_n), (dynamic, dynamic_n), (recipe, recipe_n) = of("eager"), of("compiled-dynamic-cache"), of(RECIPE)
        lines.append(f"| {name} | {batch} | {precision} | {_fmt(eager)}{eager_n} | {_fmt(dynamic)}{dynamic_n} | "
                     f"{_fmt(recipe)}{recipe_n} | {_fmt(chosen)}{_runs_text(by_label[best]) if best else ''} | "
                     f"{best or '-'} | {_saving(chosen, eager)} | {_saving(chosen, dynamic)} | "
                     f"{_saving(chosen, recipe)} |")
    return "\n".join(lines) + "\n"


def export(db_path: Path, out: Path, params: dict[str, int]) -> list[dict[str, Any]]:
    """OUT/runs_export.json (store.exchange records) and OUT/summary.md; returns the runs."""
    db = open_db(db_path)
    try:
        write_export(out / "runs_export.json", export_runs(db))
        runs = sorted(list_runs(db), key=lambda r: r["id"])
    finally:
        db.close()
    (out / "summary.md").write_text(summary_table(runs, params))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,32", help="batch sizes (concurrent sequences)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-seconds", type=float, default=5.0, help="each energy window (prefill, generation)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="eager reference + cold compile, per run")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop starting runs when fewer than --reserve-s seconds would remain (0: no limit)")
    parser.add_argument("--reserve-s", type=float, default=120.0,
                        help="time kept back for the run in progress and the export when --max-minutes is set")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--db", type=Path, help="database (default OUT/generation.db)")
    args = parser.parse_args(argv)

    started = time.time()
    unknown = [m for m in _split(args.models) if m not in MODELS] + [c for c in _split(args.configs) if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown model or configuration {unknown[0]!r}: models {', '.join(MODELS)}; configurations "
                     f"{', '.join(CONFIGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    db_path = args.db or args.out / "generation.db"
    generation = Generation(args.prompt_len, args.new_tokens)
    params = {name: param_count(MODELS[name]["spec"], MODELS[name]["options"]) for name in _split(args.models)}
    sweep = SweepLog(args.out, max_minutes=args.max_minutes, reserve_s=args.reserve_s, started=started,
                     figures=lambda run: (f"{run['energy_j_per_token']:.4g} J/token ({run['energy_source']}), TPOT "
                                          f"{run['tpot_ms_p50']:.3g} ms, TTFT {run['ttft_ms_p50']:.3g} ms, "
                                          f"{run['avg_power_w']:.0f} W avg, compile {run['compile_s']:.1f} s"))
    try:
        for name in _split(args.models):
            model = MODELS[name]
            for batch in (int(b) for b in _split(args.batches)):
                if sweep.stopped_early:
                    break
                configs = plan(_split(args.configs), _split(args.precisions), batch)
                reference = plan_recipe(_split(args.configs), _split(args.precisions), batch)
                log(f"{name} ({params_text(params[name])} parameters), batch {batch}: "
                    f"{len(configs) + len(reference)} configurations")
                # eager first, then transformers' recipe (the baseline to beat), then joulepilot's compiled ones
                eager = [c for c in configs if not c.compiles]
                sweeps = [(model["spec"], model["options"] or None, eager), (recipe_spec(name), None, reference),
                          (model["spec"], model["options"] or None, [c for c in configs if c.compiles])]
                for spec, options, planned in sweeps:
                    if not planned or sweep.stopped_early:
                        continue
                    progress = sweep.progress if spec != recipe_spec(name) else _recipe_progress(sweep.progress)
                    try:
                        bench(spec, planned, device=args.device, min_seconds=args.min_seconds, budget_s=args.budget_s,
                              db=db_path, batch_size=batch, model_options=options, generation=generation,
                              progress=progress, stop_before=sweep.out_of_time)
                    except Exception as exc:  # one model's setup failing must not end the others
                        log(f"{name}, batch {batch}: could not measure: {type(exc).__name__}: {exc}")
    finally:
        sweep.close()
    runs = export(db_path, args.out, params)
    ok = sum(r["status"] == "ok" for r in runs)
    log(f"done in {time.time() - started:.0f} s: {ok} ok, {len(runs) - ok} failed"
        + (" (stopped at the deadline: run the same command again to go on)" if sweep.stopped_early else "")
        + f"; exported to {args.out}")
    print(summary_table(runs, params), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
