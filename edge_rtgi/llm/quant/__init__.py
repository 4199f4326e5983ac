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


def apply_engine_quant(model: nn.Module, setting: str | None) -> str | None:
    """The engine's ``quant`` setting: "auto" and "none" resolved by ``edge_rtgi.device``,
    anything else passed to ``apply_quant``. Returns the spec applied (None: full precision).

    "auto" keeps a dequantised copy for many-row inputs as well (prefill, wide batches), so it
    trades memory for speed; an explicit scheme such as "int8" stores the quantised weights only.
    """
    from edge_rtgi.device import AUTO_QUANT_KERNEL_MAX_ROWS, resolve_weight_quant

    spec = resolve_weight_quant(setting, model.device, model.dtype)
    apply_quant(model, spec)
    if setting == "auto" and spec is not None:
        from edge_rtgi.llm.quant.kernels import keep_dense_copies

        keep_dense_copies(model, AUTO_QUANT_KERNEL_MAX_ROWS)
    return spec


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


__all__ = ["QuantPlan", "QuantScheme", "apply_engine_quant", "apply_quant", "apply_quant_plan", "load_quantized_checkpoint",
           "model_groups", "parse_scheme", "quantize_weight", "save_quantized_checkpoint", "uniform_plan"]
