"""Per-layer sensitivity-adaptive weight quantisation (mixed int8 / int4 on PyTorch kernels).

Public hooks for the loader and the engine:

- ``apply_quant_plan(model, plan_or_yaml_path)``: quantise a float model in place.
- ``load_quantized_checkpoint(path, base_model)``: install a saved quantised checkpoint.
- ``apply_quant(model, spec)``: either of the two, chosen by the file (``quant:`` config value).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from edge_rtgi.llm.quant.checkpoint import load_quantized_checkpoint, save_quantized_checkpoint
from edge_rtgi.llm.quant.plan import QuantPlan, apply_quant_plan, model_groups, uniform_plan
from edge_rtgi.llm.quant.schemes import QuantScheme, parse_scheme, quantize_weight


def apply_quant(model: nn.Module, spec: str | Path | None) -> dict[str, str] | None:
    """The one hook for ``quant:`` in configs: a ``.safetensors`` quantised checkpoint, a plan
    YAML path, or a scheme name applied to every group (``int8``, ``int4-g64``). None: no-op."""
    if spec in (None, "", "none"):
        return None
    text = str(spec)
    if text.endswith(".safetensors"):
        return load_quantized_checkpoint(text, model)
    if text.endswith((".yaml", ".yml")) or Path(text).is_file():
        return apply_quant_plan(model, text)
    return apply_quant_plan(model, uniform_plan(model_groups(model), text))


__all__ = ["QuantPlan", "QuantScheme", "apply_quant", "apply_quant_plan", "load_quantized_checkpoint",
           "model_groups", "parse_scheme", "quantize_weight", "save_quantized_checkpoint", "uniform_plan"]
