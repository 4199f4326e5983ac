"""Sensitivity profiling: how much each weight group, quantised alone, moves the model's output.

For every group (layer x {qkv, o, gate_up, down}, plus lm_head) and every candidate scheme, the
group alone is replaced by its quantised weights and the mean KL divergence KL(full || quantised)
of the next-token distributions is measured over calibration windows.

Cost control: the full model runs once per window, keeping the hidden state that enters each
layer and the reference log-probabilities. Quantising a group in layer ``l`` only changes layers
``l..L-1``, so each (group, scheme) trial re-runs just those layers from the cached input: on
average half a forward pass, and the LM head alone for ``lm_head``. Trials use the dequantised
weights (the exact values the kernels read, bf16-rounded scales included) in a float matmul, so
profiling runs in fp32 with a clean reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor
from tqdm import tqdm

from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.model import ContiguousKVCache, Transformer
from edge_rtgi.llm.quant.plan import WeightGroup, float_linear, model_groups
from edge_rtgi.llm.quant.schemes import parse_scheme, quantiser_name, quantize_weight

SENSITIVITY_FORMAT = "edge-rtgi-quant-sensitivity/1"
HELDOUT_MARKER = "=== held-out ==="
DEFAULT_SCHEMES = ("int8", "int4-g32", "int4-g64", "int4-g128", "int4sym-g32", "int4sym-g64", "int4sym-g128")


def calibration_text(part: str = "calibration") -> str:
    """One of the project's texts: ``"calibration"`` (profiling), or for evaluation ``"eval"``
    (``bench/data/quant_eval.txt``, ~7,300 tokens) or ``"heldout"`` (the calibration file's
    short held-out tail, ~690 tokens). None of the evaluation texts is used for profiling."""
    root = Path(__file__).resolve().parents[2]
    if part == "eval":
        return (root / "bench" / "data" / "quant_eval.txt").read_text(encoding="utf-8").strip()
    if part not in ("calibration", "heldout"):
        raise ValueError(f"unknown text {part!r}: use 'calibration', 'eval' or 'heldout'")
    text = (root / "data" / "calibration.txt").read_text(encoding="utf-8")
    calib, _, heldout = text.partition(HELDOUT_MARKER)
    return calib.strip() if part == "calibration" else heldout.strip()


def token_windows(tokenizer, text: str, window_tokens: int, max_windows: int) -> list[Tensor]:
    """Cut ``text`` into up to ``max_windows`` non-overlapping windows of ``window_tokens`` ids."""
    ids = tokenizer.encode(text) if hasattr(tokenizer, "encode") else tokenizer(text)
    ids = list(getattr(ids, "ids", ids))
    count = min(max_windows, len(ids) // window_tokens)
    if count == 0:
        raise ConfigError(
            f"calibration text has {len(ids)} tokens, fewer than one window of {window_tokens}",
            hint="use a longer text or a smaller --window-tokens",
        )
    return [torch.tensor(ids[i * window_tokens : (i + 1) * window_tokens]) for i in range(count)]


@dataclass
class Calibration:
    """Cached full-model activations: per window, the input of every layer and the final hidden."""

    windows: list[Tensor]
    layer_inputs: list[list[Tensor]]  # [window][layer] -> [W, hidden]
    final_hidden: list[Tensor]  # [window] -> [W, hidden] (after the final norm)
    ref_logprobs: list[Tensor]  # [window] -> [W, vocab] fp32

    @property
    def num_tokens(self) -> int:
        return sum(len(w) for w in self.windows)


def _run_layers(model: Transformer, x: Tensor, start: int, cache: ContiguousKVCache) -> Tensor:
    positions = torch.arange(x.shape[0])
    cos, sin = model.rotary(positions, x.dtype)
    cache.length = 0
    cache.begin(x.shape[0])
    for layer in model.layers[start:]:
        x = layer(x, cos, sin, cache)
    return model.norm(x)


@torch.no_grad()
def calibrate(model: Transformer, windows: list[Tensor]) -> Calibration:
    """One full forward per window, keeping each layer's input and the reference log-probs."""
    cfg = model.config
    cache = ContiguousKVCache(cfg, max(len(w) for w in windows), model.dtype, model.device)
    inputs, finals, refs = [], [], []
    for ids in windows:
        x = model.embed_tokens(ids.to(model.device))
        per_layer = []
        positions = torch.arange(len(ids))
        cos, sin = model.rotary(positions, x.dtype)
        cache.length = 0
        cache.begin(len(ids))
        for layer in model.layers:
            per_layer.append(x)
            x = layer(x, cos, sin, cache)
        hidden = model.norm(x)
        inputs.append(per_layer)
        finals.append(hidden)
        refs.append(F.log_softmax(model.compute_logits(hidden), dim=-1))
    return Calibration(windows, inputs, finals, refs)


@torch.no_grad()
def collect_importance(
    model: Transformer, tokenizer, text: str | None = None, window_tokens: int = 256, max_windows: int = 16
) -> dict[str, Tensor]:
    """Mean squared input activation per input channel of every quantisable group ([in_features]
    fp32 each, keyed by group name): the "importance matrix" that ``quantize_weight`` fits grids to.

    Runs the model as it is over the calibration text (all of it by default: about 2,600 tokens
    in 10 windows for SmolLM2's tokenizer), with forward pre-hooks on the groups' linears.
    """
    windows = token_windows(
        tokenizer, text if text is not None else calibration_text(), window_tokens, max_windows
    )
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def accumulate(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + (x * x).sum(0).cpu()
            counts[name] = counts.get(name, 0) + x.shape[0]

        return accumulate

    groups = model_groups(model)
    handles = [model.get_submodule(g.module_path).register_forward_pre_hook(hook(g.name)) for g in groups]
    try:
        cache = ContiguousKVCache(model.config, window_tokens, model.dtype, model.device)
        for ids in windows:
            hidden = _run_layers(model, model.embed_tokens(ids.to(model.device)), 0, cache)
            model.compute_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()
    missing = [g.name for g in groups if g.name not in sums]
    if missing:  # a custom forward that skips a linear
        raise ConfigError(
            f"no activations reached {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
            hint="collect importance on a float model loaded with load_model",
        )
    return {name: sums[name] / counts[name] for name in sums}


def mean_kl(ref_logprobs: Tensor, logits: Tensor) -> float:
    """Mean over tokens of KL(ref || q) in nats, from reference log-probs and new logits."""
    logq = F.log_softmax(logits.float(), dim=-1)
    return float((ref_logprobs.exp() * (ref_logprobs - logq)).sum(-1).mean())


@torch.no_grad()
def group_kl(
    model: Transformer,
    calib: Calibration,
    group: WeightGroup,
    layer_index: int | None,
    cache: ContiguousKVCache,
) -> float:
    """Mean KL over all calibration windows with the model as it is now (one group swapped)."""
    total = 0.0
    for w, ids in enumerate(calib.windows):
        if group.tied_embedding:  # a tied head is also the embedding table: everything changes
            hidden = _run_layers(model, model.embed_tokens(ids.to(model.device)), 0, cache)
        elif layer_index is None:  # an untied lm_head: only the projection changes
            hidden = calib.final_hidden[w]
        else:
            hidden = _run_layers(model, calib.layer_inputs[w][layer_index], layer_index, cache)
        total += mean_kl(calib.ref_logprobs[w], model.compute_logits(hidden)) * len(ids)
    return total / calib.num_tokens


@dataclass
class SensitivityTable:
    """KL (nats/token) per group per scheme, plus how it was measured."""

    kl: dict[str, dict[str, float]]
    shapes: dict[str, tuple[int, int]]
    info: dict = field(default_factory=dict)

    def to_yaml(self) -> str:
        groups = {
            name: {"shape": list(self.shapes[name]), **{s: float(f"{v:.4g}") for s, v in row.items()}}
            for name, row in self.kl.items()
        }
        doc = {
            "format": SENSITIVITY_FORMAT,
            "metric": "mean KL(full || quantised) of next-token "
            "distributions, nats per token; each group quantised alone",
            **self.info,
            "groups": groups,
        }
        return yaml.safe_dump(doc, sort_keys=False, width=120)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> SensitivityTable:
        try:
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read sensitivity table {path}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != SENSITIVITY_FORMAT:
            raise ConfigError(
                f"{path} is not a sensitivity table", hint="create one with edge-rtgi quantize --profile"
            )
        kl, shapes = {}, {}
        for name, row in doc["groups"].items():
            row = dict(row)
            shapes[name] = tuple(row.pop("shape"))
            kl[name] = {s: float(v) for s, v in row.items()}
        info = {k: v for k, v in doc.items() if k not in ("format", "metric", "groups")}
        return cls(kl, shapes, info)


@torch.no_grad()
def profile_sensitivity(
    model: Transformer,
    tokenizer,
    schemes: tuple[str, ...] = DEFAULT_SCHEMES,
    window_tokens: int = 256,
    max_windows: int = 4,
    text: str | None = None,
    progress: bool = True,
    importance: dict[str, Tensor] | None = None,
) -> SensitivityTable:
    """Measure the sensitivity table of a float model (not modified on return).

    ``importance`` (from ``collect_importance``): quantise each trial as the plan will be applied,
    with importance-fitted grids. The table records which quantiser it measured.
    """
    parsed = [parse_scheme(s) for s in schemes]
    started = time.perf_counter()
    windows = token_windows(
        tokenizer, text if text is not None else calibration_text(), window_tokens, max_windows
    )
    calib = calibrate(model, windows)
    groups = model_groups(model)
    cache = ContiguousKVCache(model.config, window_tokens, model.dtype, model.device)
    trials = [(g, s) for g in groups for s in parsed if g.allowed(s)]
    kl: dict[str, dict[str, float]] = {g.name: {} for g in groups}
    bar = tqdm(trials, desc="sensitivity", unit="trial", disable=not progress)
    for group, scheme in bar:
        bar.set_postfix_str(f"{group.name} {scheme.name}")
        module = float_linear(model, group)
        original = module.weight.data
        weights = None if importance is None else importance[group.name]
        module.weight.data = (
            quantize_weight(original, scheme, weights).dequantize().to(original.dtype, copy=False)
        )
        try:
            layer = None if group.name == "lm_head" else int(group.name.split(".")[1])
            kl[group.name][scheme.name] = group_kl(model, calib, group, layer, cache)
        finally:
            module.weight.data = original
    info = {
        "calibration": {"tokens": calib.num_tokens, "windows": len(windows), "window_tokens": window_tokens},
        "dtype": str(model.dtype).replace("torch.", ""),
        "seconds": round(time.perf_counter() - started, 1),
        "quantiser": quantiser_name(importance),
    }
    return SensitivityTable(kl, {g.name: (g.out_features, g.in_features) for g in groups}, info)
