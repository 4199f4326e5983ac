"""Per-layer sensitivity-adaptive weight quantisation (mixed int8 / int4 on PyTorch kernels).

Public hooks for the loader and the engine:

- ``apply_quant_plan(model, plan_or_yaml_path)``: quantise a float model in place.
- ``load_quantized_checkpoint(path, base_model)``: install a saved quantised checkpoint.
- ``apply_quant(model, spec)``: either of the two, chosen by the file (``quant:`` config value).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from edge_rtgi.llm.quant.checkpoint import load_quantized_checkpoint, save_quantized_checkpoint
from edge_rtgi.llm.quant.plan import (
    QuantPlan,
    apply_quant_plan,
    check_plan_inputs,
    model_groups,
    uniform_plan,
)
from edge_rtgi.llm.quant.policy import auto_quant_kernel_max_rows, resolve_weight_quant, source_aligned_scheme
from edge_rtgi.llm.quant.schemes import QuantScheme, parse_scheme, quantize_weight

if TYPE_CHECKING:
    from edge_rtgi.llm.model import Transformer

log = logging.getLogger(__name__)


def apply_engine_quant(model: Transformer, setting: str | None, tokenizer=None) -> str | None:
    """The engine's ``quant`` setting: "auto" and "none" resolved by ``policy.resolve_weight_quant``,
    anything else passed to ``apply_quant``. Returns what was applied, in words (None: full
    precision).

    "auto" keeps 4-bit source blocks in the kernel scheme that reproduces them
    (``source_aligned_plan``) and a dequantised copy for many-row inputs (prefill, wide
    batches), so it trades memory for speed; an explicit scheme such as "int8" stores the
    quantised weights only, fitted to the calibration text's activations when ``tokenizer`` is
    given (see ``apply_quant``).
    """
    spec = resolve_weight_quant(setting, model.device, model.dtype)
    if setting != "auto" or spec is None:
        apply_quant(model, spec, tokenizer)
        return spec
    from edge_rtgi.llm.quant.kernels import keep_dense_copies

    plan = source_aligned_plan(model, spec)
    resolved = apply_quant_plan(model, plan, grids=source_grids(model, plan))
    keep_dense_copies(model, auto_quant_kernel_max_rows())
    counts = Counter(resolved.values())
    return " + ".join(f"{scheme} x{n}" for scheme, n in counts.most_common())


def source_aligned_plan(model: Transformer, default: str) -> QuantPlan:
    """``default`` for every group, except groups whose weights the model file stored in a
    format that a kernel scheme reproduces (``policy.source_aligned_scheme``, from
    ``model.source_weight_formats``): those keep their precision in that scheme."""
    formats = getattr(model, "source_weight_formats", {}) or {}
    schemes = {}
    others: Counter[str] = Counter()
    for group in model_groups(model):
        param = _group_param(group)
        aligned = source_aligned_scheme(formats.get(param))
        if aligned is not None and group.allowed(parse_scheme(aligned)):
            schemes[group.name] = aligned
        else:
            others[formats.get(param, "unknown")] += 1
    if others and schemes:
        log.info(
            "quant auto: %d groups keep the file's 4-bit blocks; %s have no kernel format that "
            "reproduces their blocks (or their parts differ), so they get %s",
            len(schemes),
            ", ".join(f"{n} stored as {kind}" for kind, n in others.most_common()),
            default,
        )
    return QuantPlan(
        schemes, default, notes={"policy": "auto: source-aligned where the file allows, else " + default}
    )


def _group_param(group) -> str:
    return "embed_tokens.weight" if group.tied_embedding else f"{group.module_path}.weight"


def source_grids(model: Transformer, plan: QuantPlan) -> dict:
    """The file's own int4 grids (``Transformer.source_grids``) of the groups ``plan`` gives the
    scheme that reproduces them: quantising on them keeps the file's codes."""
    grids = getattr(model, "source_grids", {}) or {}
    out = {}
    for group in model_groups(model):
        grid = grids.get(_group_param(group))
        if grid is not None and plan.schemes.get(group.name) == "int4-g32":
            out[group.name] = grid
    return out


def apply_quant(model: Transformer, spec: str | Path | None, tokenizer=None) -> dict[str, str] | None:
    """The one hook for ``quant:`` in configs: a ``.safetensors`` quantised checkpoint, a plan
    YAML path, or a scheme name applied to every group (``int8``, ``int4-g64``). None: no-op.

    A plan or scheme quantises at load time. With ``tokenizer``, the grids are fitted to the
    activations of the shipped calibration text (``collect_importance``: one forward pass over
    ~2,600 tokens plus the fitting, about 15 s for SmolLM2-135M on 2 cores); without it, they
    span each group's range. A saved checkpoint loads without either.
    """
    if spec in (None, "", "none"):
        return None
    text = str(spec)
    if text.endswith(".safetensors"):
        return load_quantized_checkpoint(text, model)
    is_plan = text.endswith((".yaml", ".yml")) or Path(text).is_file()
    groups = model_groups(model)
    plan = QuantPlan.load(text) if is_plan else uniform_plan(groups, text)
    # a bad plan (resolved() validates it) or an already quantised model is refused
    # before the calibration pass
    check_plan_inputs(model, groups, plan.resolved(groups))
    importance = None
    if tokenizer is not None:
        from edge_rtgi.llm.quant.profile import collect_importance

        importance = collect_importance(model, tokenizer)
    return apply_quant_plan(model, plan, importance=importance)


__all__ = [
    "QuantPlan",
    "QuantScheme",
    "apply_engine_quant",
    "apply_quant",
    "apply_quant_plan",
    "load_quantized_checkpoint",
    "model_groups",
    "parse_scheme",
    "quantize_weight",
    "save_quantized_checkpoint",
    "source_aligned_plan",
    "uniform_plan",
]
