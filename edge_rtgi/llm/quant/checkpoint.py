"""Quantised checkpoints: packed weights in safetensors, with the plan in the file's metadata.

The file holds, per quantised group, ``{group}.qweight``, ``{group}.scales`` (and ``.zeros`` for
int4), in the portable ``PackedWeight`` form. Norms, biases and other float tensors come from
the base model it is loaded onto, which also supplies the tokenizer.
Loading repacks into the kernels' layouts and never re-quantises, so it takes well under a
second for a 135 M model. A checkpoint whose plan or shapes do not match the base model is
refused, naming what differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from edge_rtgi.errors import ModelFileError
from edge_rtgi.llm.quant.plan import (
    QuantPlan,
    check_plan_inputs,
    float_linear,
    install_packed,
    model_groups,
    warn_if_slow_activations,
)
from edge_rtgi.llm.quant.schemes import PackedWeight, parse_scheme, quantiser_name, quantize_weight

if TYPE_CHECKING:
    from edge_rtgi.llm.model import Transformer

CHECKPOINT_FORMAT = "edge-rtgi-quant/1"


def _fingerprint(model: Transformer) -> dict:
    cfg = model.config
    return {
        "arch": cfg.arch,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
    }


def save_quantized_checkpoint(
    model: Transformer, plan: QuantPlan, path: str | Path, importance: dict[str, torch.Tensor] | None = None
) -> dict[str, str]:
    """Quantise the float ``model``'s groups per ``plan`` and write them to ``path`` (.safetensors).

    ``importance``: as for ``apply_quant_plan``; the fitted codes are what is stored, so loading
    needs no calibration. The model itself is not modified. Returns the resolved plan.
    """
    groups = model_groups(model)
    resolved = plan.resolved(groups)
    check_plan_inputs(model, groups, resolved, importance)
    tensors: dict[str, torch.Tensor] = {}
    shapes = {}
    for group in groups:
        scheme = parse_scheme(resolved[group.name])
        if scheme.bits == 16:
            continue
        packed = quantize_weight(
            float_linear(model, group).weight, scheme, None if importance is None else importance[group.name]
        )
        tensors[f"{group.name}.qweight"] = packed.qweight
        tensors[f"{group.name}.scales"] = packed.scales
        if packed.zeros is not None:
            tensors[f"{group.name}.zeros"] = packed.zeros
        shapes[group.name] = [group.out_features, group.in_features]
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "plan": QuantPlan(
            resolved, plan.default, {**plan.notes, "quantiser": quantiser_name(importance)}
        ).to_yaml(),
        "model": json.dumps(_fingerprint(model)),
        "shapes": json.dumps(shapes),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return resolved


def read_checkpoint_plan(path: str | Path) -> tuple[QuantPlan, dict, dict]:
    """(plan, model fingerprint, shapes) from a checkpoint's metadata, without reading tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise ModelFileError(f"cannot read quantised checkpoint {path}: {exc}") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ModelFileError(
            f"{path} is not an edge-rtgi quantised checkpoint",
            hint="create one with: edge-rtgi quantize MODEL --target-bits B --save FILE",
        )
    plan = QuantPlan.from_yaml(meta["plan"], f"{path} (metadata)")
    return plan, json.loads(meta.get("model", "{}")), json.loads(meta.get("shapes", "{}"))


def _check_matches(
    path: str | Path, model: Transformer, plan: QuantPlan, fingerprint: dict, shapes: dict
) -> None:
    groups = {g.name: g for g in model_groups(model)}
    problems = []
    mine = _fingerprint(model)
    problems += [
        f"{k}: checkpoint {fingerprint[k]} vs model {mine[k]}"
        for k in mine
        if k in fingerprint and fingerprint[k] != mine[k]
    ]
    problems += [f"{name}: not in the model" for name in sorted(set(plan.schemes) - set(groups))]
    for name, shape in shapes.items():
        g = groups.get(name)
        if g is not None and [g.out_features, g.in_features] != shape:
            problems.append(
                f"{name}: checkpoint {shape[0]}x{shape[1]} vs model {g.out_features}x{g.in_features}"
            )
    if problems:
        raise ModelFileError(
            f"quantised checkpoint {path} does not match the model: " + "; ".join(problems),
            hint="load it onto the model it was made from, or re-run edge-rtgi quantize",
        )


def load_quantized_checkpoint(path: str | Path, base_model: Transformer) -> dict[str, str]:
    """Install the packed groups of checkpoint ``path`` into the float ``base_model`` in place.

    Returns the resolved plan. Raises ``ModelFileError`` naming each mismatch.
    """
    plan, fingerprint, shapes = read_checkpoint_plan(path)
    _check_matches(path, base_model, plan, fingerprint, shapes)
    groups = model_groups(base_model)
    resolved = plan.resolved(groups)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for group in groups:
            scheme = parse_scheme(resolved[group.name])
            if scheme.bits == 16:
                continue
            if f"{group.name}.qweight" not in names:
                raise ModelFileError(f"quantised checkpoint {path} lacks tensors for {group.name}")
            zeros = f.get_tensor(f"{group.name}.zeros") if scheme.bits == 4 else None
            packed = PackedWeight(
                scheme,
                group.out_features,
                group.in_features,
                f.get_tensor(f"{group.name}.qweight"),
                f.get_tensor(f"{group.name}.scales"),
                zeros,
            )
            install_packed(base_model, group, packed)
    warn_if_slow_activations(base_model)
    return resolved
