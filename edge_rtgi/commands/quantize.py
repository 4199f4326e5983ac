"""``edge-rtgi quantize MODEL``: profile sensitivity, allocate bits, save a plan/checkpoint, report.

Typical use::

    edge-rtgi quantize smollm2-135m-instruct --profile --out sens.yaml
    edge-rtgi quantize smollm2-135m-instruct --sensitivity sens.yaml --target-bits 4.6 \\
        --plan-out plan.yaml --save smollm2.q.safetensors --report report/

The steps run in that order and any subset can be given in one call.

KV precision per layer goes through the same table and allocator (docs/engine.md "KV precision
per layer")::

    edge-rtgi quantize smollm2-135m-instruct --profile-kv --out kv-sens.yaml
    edge-rtgi quantize smollm2-135m-instruct --sensitivity kv-sens.yaml --target-kv-bits 7 \
        --plan-out kv-plan.yaml    # then engine: {kv_dtype: plan, kv_plan: kv-plan.yaml}
"""

from __future__ import annotations

import argparse
import copy
import sys

from edge_rtgi.errors import ConfigError


def _plan_from_args(args, loaded, table, quantiser: str):
    from edge_rtgi.llm.quant.allocate import Budget, allocate
    from edge_rtgi.llm.quant.plan import QuantPlan, model_groups, uniform_plan
    from edge_rtgi.llm.quant.profile import SensitivityTable

    groups = model_groups(loaded.model)
    if args.plan and args.uniform:
        raise ConfigError("give --plan or --uniform, not both")
    if args.plan:
        plan = QuantPlan.load(args.plan)
        plan.validate(groups)
        return plan
    if args.uniform:
        return uniform_plan(groups, args.uniform)
    if args.target_bits is None and args.max_mb is None:
        return None
    if table is None:
        if not args.sensitivity:
            raise ConfigError(
                "a budget needs a sensitivity table",
                hint="add --profile, or --sensitivity FILE from an earlier --profile run",
            )
        table = SensitivityTable.load(args.sensitivity)
        measured = table.info.get("quantiser", "min-max")
        if measured != quantiser:
            print(
                f"warning: {args.sensitivity} was measured with {measured} grids, but this run quantises "
                f"with {quantiser} grids; the allocation will follow the wrong sensitivities "
                f"(profile again, or pass --grids {measured})",
                file=sys.stderr,
            )
    budget = Budget.from_args(groups, args.target_bits, args.max_mb)
    schemes = tuple(args.schemes.split(",")) if args.schemes else None
    plan = allocate(groups, table, budget, schemes)
    out = args.plan_out or "plan.yaml"
    plan.save(out, groups)
    print(
        f"plan: {plan.notes['bits_per_weight']} bits/weight, {plan.notes['size_mb']} MB -> {out}",
        file=sys.stderr,
    )
    return plan


def _task_retention(quant, full, items: int | None) -> list:
    """The quantised model served by the engine on the graded task sets, against the full model."""
    from edge_rtgi.bench.task_eval import FullOutputCache, evaluate
    from edge_rtgi.bench.tasks import TASK_SET_NAMES
    from edge_rtgi.llm.engine import LLMEngine
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.llm.quant.report import TaskRetentionLine

    engine = LLMEngine(quant, full.tokenizer, EngineConfig(quant="none"))
    try:
        results = evaluate(engine, full, TASK_SET_NAMES, items, FullOutputCache.default())
    finally:
        engine.shutdown()
    return [
        TaskRetentionLine(
            name,
            r.metric,
            r.interval.n,
            r.interval.full_score,
            r.interval.optimised_score,
            r.retention,
            r.interval.low,
            r.interval.high,
        )
        for name, r in results.items()
    ]


def _profile_kv(args, loaded, run_dtype, table):
    """The KV rows (``kv_profile``), measured in the activation dtype, merged into ``table``."""
    import torch

    from edge_rtgi.llm.quant.kv_profile import KV_SCHEMES, profile_kv_sensitivity

    schemes = tuple(args.kv_schemes.split(",")) if args.kv_schemes else KV_SCHEMES
    work = loaded.model if run_dtype == torch.float32 else copy.deepcopy(loaded.model).to(run_dtype)
    kv_table = profile_kv_sensitivity(
        work,
        loaded.tokenizer,
        tuple(s for s in schemes if s != "auto"),
        args.window_tokens,
        args.calib_windows,
        progress=not args.quiet,
    )
    del work
    if table is None:
        kv_table.info["model"] = str(args.model)
        return kv_table
    table.kl.update(kv_table.kl)
    table.shapes.update(kv_table.shapes)
    table.info.update(kv_table.info)
    return table


def _add_kv_plan(args, loaded, table, plan) -> None:
    """Allocate the KV precision per layer under ``--target-kv-bits`` and write it, in the plan's
    ``kv`` section (with the weight plan of this call, if any), to ``--plan-out``."""
    from edge_rtgi.device import resolve_dtype
    from edge_rtgi.llm.quant.allocate import Budget, allocate_kv
    from edge_rtgi.llm.quant.plan import QuantPlan, model_groups, model_kv_layers
    from edge_rtgi.llm.quant.profile import SensitivityTable

    if table is None:
        if not args.sensitivity:
            raise ConfigError(
                "--target-kv-bits needs a sensitivity table with KV rows",
                hint="add --profile-kv, or --sensitivity FILE from an earlier --profile-kv run",
            )
        table = SensitivityTable.load(args.sensitivity)
    # "auto" layers cost what the engine's default dtype takes (bf16 on a bf16 CPU), whatever
    # --dtype the profile ran in (fp32 resolves the signal below bf16's noise floor)
    layers = model_kv_layers(loaded.model, dtype=resolve_dtype("auto", loaded.model.device))
    budget = Budget.from_args(layers, args.target_kv_bits, None, flag="--target-kv-bits")
    schemes = tuple(args.kv_schemes.split(",")) if args.kv_schemes else None
    kv = allocate_kv(layers, table, budget, schemes)
    out = args.plan_out or "plan.yaml"
    full = plan if plan is not None else QuantPlan()
    full.kv = kv
    full.save(out, model_groups(loaded.model) if plan is not None else None, len(layers))
    print(
        f"kv plan: {kv.notes['kv_bits']} bits per KV value, {kv.notes['kv_bytes_per_token']:.0f} bytes "
        f"per token -> {out}",
        file=sys.stderr,
    )


def cmd_quantize(args) -> int:
    import torch

    from edge_rtgi.device import resolve_dtype
    from edge_rtgi.llm.quant.checkpoint import save_quantized_checkpoint
    from edge_rtgi.llm.quant.plan import apply_quant_plan, model_groups
    from edge_rtgi.llm.quant.profile import (
        DEFAULT_SCHEMES,
        calibration_text,
        collect_importance,
        profile_sensitivity,
    )
    from edge_rtgi.llm.quant.report import compare_quality, write_report
    from edge_rtgi.llm.quant.schemes import quantiser_name
    from edge_rtgi.llm.weights import load_model

    kv_work = args.profile_kv or args.target_kv_bits is not None
    if not (args.profile or args.target_bits or args.max_mb or args.plan or args.uniform or kv_work):
        raise ConfigError(
            "nothing to do",
            hint="give --profile, a budget (--target-bits/--max-mb), --plan or --uniform; "
            "or --profile-kv, --target-kv-bits",
        )
    if args.task_items is not None and args.task_items < 0:
        raise ConfigError(
            f"--task-items must be at least 0, got {args.task_items}",
            hint="leave it out for every graded item, or 0 to skip the task retention",
        )
    if args.eval_prompts < 1:
        raise ConfigError(
            f"--eval-prompts must be at least 1, got {args.eval_prompts}",
            hint="64 (the default) places the prompts side by side; 448 overlaps them",
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    # The full model stays fp32 (the benchmark's reference, and the best source to quantise from);
    # profiling and the quantised model run in the activation dtype the kernels will see.
    loaded = load_model(args.model, device=args.device, dtype="fp32")
    run_dtype = resolve_dtype(args.dtype, loaded.model.device)
    importance = None
    needs_weights = args.profile or args.save or args.report
    if args.grids == "fitted" and needs_weights:  # the full model's activations on the calibration text, once
        importance = collect_importance(loaded.model, loaded.tokenizer)
    table = None
    if args.profile:
        schemes = tuple(args.schemes.split(",")) if args.schemes else DEFAULT_SCHEMES
        work = loaded.model if run_dtype == torch.float32 else copy.deepcopy(loaded.model).to(run_dtype)
        table = profile_sensitivity(
            work,
            loaded.tokenizer,
            schemes,
            args.window_tokens,
            args.calib_windows,
            progress=not args.quiet,
            importance=importance,
        )
        del work
        table.info["model"] = str(args.model)
    if args.profile_kv:
        table = _profile_kv(args, loaded, run_dtype, table)
    if args.profile or args.profile_kv:
        assert table is not None
        out = args.out or "sensitivity.yaml"
        table.save(out)
        seconds = table.info.get("seconds", 0) + table.info.get("kv_seconds", 0)
        print(f"sensitivity table ({seconds:.1f} s) -> {out}", file=sys.stderr)
    plan = _plan_from_args(args, loaded, table, quantiser_name({} if args.grids == "fitted" else None))
    if args.target_kv_bits is not None:
        _add_kv_plan(args, loaded, table, plan)
    if plan is None:
        return 0
    if args.save:
        save_quantized_checkpoint(loaded.model, plan, args.save, importance)
        print(f"quantised checkpoint -> {args.save}", file=sys.stderr)
    if args.report:
        groups = model_groups(loaded.model)
        quant = copy.deepcopy(loaded.model)
        resolved = apply_quant_plan(quant, plan, dtype=run_dtype, importance=importance)
        quality = compare_quality(
            loaded.model, quant, loaded.tokenizer, calibration_text("eval"), max_prompts=args.eval_prompts
        )
        full_bytes = sum(2 * g.numel for g in groups)
        tasks = _task_retention(quant, loaded, args.task_items) if args.task_items != 0 else []
        path = write_report(args.report, resolved, groups, quality, str(args.model), full_bytes, tasks)
        print(path.read_text(encoding="utf-8").split("\n\n![")[0])
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize",
        help="per-layer mixed int8/int4 quantisation: profile, plan, save, report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="catalogue name, HF folder or .gguf file")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="activation dtype (auto: bf16 where the CPU has it)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--grids",
        choices=("fitted", "min-max"),
        default="fitted",
        help="fitted (default): each group's scale and zero minimise the error weighted by the "
        "calibration text's activations; min-max: span each group's range",
    )
    prof = p.add_argument_group("sensitivity profiling")
    prof.add_argument("--profile", action="store_true", help="measure the sensitivity table")
    prof.add_argument("--out", help="where --profile writes the table (default sensitivity.yaml)")
    prof.add_argument(
        "--schemes", help="comma-separated candidate schemes (default: int8 and int4/int4sym g32/64/128)"
    )
    prof.add_argument("--calib-windows", type=int, default=1, help="calibration windows (default 1)")
    prof.add_argument(
        "--window-tokens", type=int, default=256, help="tokens per calibration window (default 256)"
    )
    prof.add_argument(
        "--profile-kv",
        action="store_true",
        help="measure each layer's KV sensitivity (int8, int4) into the same table (rows layers.N.kv)",
    )
    prof.add_argument("--kv-schemes", help="comma-separated KV precisions (default: auto, int8, int4)")
    alloc = p.add_argument_group("bit allocation")
    alloc.add_argument("--sensitivity", help="a table from an earlier --profile")
    alloc.add_argument("--target-bits", type=float, help="average bits per weight, scales and zeros included")
    alloc.add_argument("--max-mb", type=float, help="size cap of the quantised groups in MB (10^6 bytes)")
    alloc.add_argument(
        "--target-kv-bits",
        type=float,
        help="average bits per cached KV value (scales included; bf16 16, int8 8.5, int4 5.5 for "
        "SmolLM2): a KV precision per layer, in the plan's kv section",
    )
    alloc.add_argument("--plan-out", help="where the chosen plan goes (default plan.yaml)")
    alloc.add_argument("--plan", help="use this plan YAML instead of allocating")
    alloc.add_argument("--uniform", help="one scheme everywhere (e.g. int8, int4-g64) instead of allocating")
    out = p.add_argument_group("outputs")
    out.add_argument("--save", help="write a quantised checkpoint (.safetensors)")
    out.add_argument("--report", metavar="DIR", help="write report.md, report.json and bits.png to DIR")
    out.add_argument(
        "--eval-prompts",
        type=int,
        default=64,
        help="greedy-continuation prompts for the report's continuation chrF, a fidelity diagnostic "
        "(default 64, side by side; more overlap and narrow its interval)",
    )
    out.add_argument(
        "--task-items",
        type=int,
        default=None,
        help="graded items per task set for the report's task retention, the figure that judges a plan "
        "(default: every item; 0: skip)",
    )
    p.set_defaults(func=cmd_quantize)
