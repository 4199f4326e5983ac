"""Quantisation plans: which scheme each weight group gets, checked against a model, and applied.

Groups are the fused linears of ``edge_rtgi.llm.model``: ``layers.{i}.qkv``, ``layers.{i}.o``,
``layers.{i}.gate_up``, ``layers.{i}.down`` and ``lm_head``. A plan is a small YAML file::

    format: edge-rtgi-quant-plan/1
    default: int4-g64          # groups not listed below (optional; "none" when absent)
    groups:
      lm_head: int8
      layers.0.down: int8

A plan that names a group the model does not have is refused with the names, and so is a scheme
that does not fit a group's shape.

A plan may also carry a ``kv`` section: the precision each layer's KV cache is kept in
(``kv_dtype: plan`` with ``kv_plan: PATH`` in the engine settings; ``kv.mixed``). Entries are named
like weight groups, ``layers.{i}.kv``, and take the values ``kv_dtype`` takes for the whole model::

    kv:
      default: int4            # layers not listed below ("auto", the model's dtype, when absent)
      layers:
        layers.0.kv: auto
        layers.3.kv: int8

Either section may be absent; ``edge-rtgi quantize --target-kv-bits`` writes the ``kv`` one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from torch import nn

from edge_rtgi.device import cpu_has_bf16
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.kv.mixed import LAYER_KV_DTYPES, mixed_bytes_per_block
from edge_rtgi.llm.quant.kernels import (
    QuantLinear,
    TiedQuantEmbedding,
    cpu_int4_layout_ok,
    make_quant_linear,
)
from edge_rtgi.llm.quant.schemes import PackedWeight, QuantScheme, parse_scheme, quantize_weight

if TYPE_CHECKING:
    from edge_rtgi.llm.model import Transformer

log = logging.getLogger(__name__)

PLAN_FORMAT = "edge-rtgi-quant-plan/1"
_KIND_PATHS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}
GROUP_KINDS = tuple(_KIND_PATHS)


@dataclass(frozen=True)
class WeightGroup:
    """One quantisable matrix: its plan name, module path and shape [out, in]."""

    name: str
    module_path: str
    out_features: int
    in_features: int
    tied_embedding: bool = False

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    def option_nbytes(self, scheme: str) -> int | None:
        """Bytes of this matrix in ``scheme`` (None: the scheme does not fit it)."""
        parsed = parse_scheme(scheme)
        return parsed.nbytes(self.out_features, self.in_features) if self.allowed(parsed) else None

    def allowed(self, scheme: QuantScheme) -> bool:
        if not scheme.fits(self.out_features, self.in_features):
            return False
        # A tied int4 head is also the embedding table; row lookups need the 64-row CPU layout.
        if self.tied_embedding and scheme.bits == 4:
            return self.out_features % 64 == 0 and cpu_int4_layout_ok()
        return True


def model_groups(model: Transformer) -> list[WeightGroup]:
    """The quantisable groups of a ``Transformer``, in forward order."""
    cfg = model.config
    groups = []
    for i in range(cfg.num_layers):
        for kind, path in _KIND_PATHS.items():
            mod = model.get_submodule(f"layers.{i}.{path}")
            if not isinstance(mod, (nn.Linear, QuantLinear)):
                raise TypeError(f"layers.{i}.{path} is a {type(mod).__name__}, not a linear layer")
            groups.append(
                WeightGroup(f"layers.{i}.{kind}", f"layers.{i}.{path}", mod.out_features, mod.in_features)
            )
    groups.append(
        WeightGroup(
            "lm_head",
            "lm_head",
            cfg.vocab_size,
            cfg.hidden_size,
            tied_embedding=bool(cfg.tie_word_embeddings),
        )
    )
    return groups


def kv_layer_name(layer: int) -> str:
    """A layer's KV entry in plans and sensitivity tables."""
    return f"layers.{layer}.kv"


@dataclass(frozen=True)
class KVLayer:
    """One layer's KV cache as an allocation item: its bytes per block in each precision
    (``kv.mixed``), and ``numel``, the values one block of it holds (keys and values)."""

    name: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    def option_nbytes(self, scheme: str) -> int | None:
        """Bytes one block of this layer takes in precision ``scheme`` (None: not one)."""
        if scheme not in LAYER_KV_DTYPES:
            return None
        if scheme == "int4" and self.head_dim % 2:
            return None
        return mixed_bytes_per_block([scheme], self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


def model_kv_layers(
    model: Transformer, block_size: int = 16, dtype: torch.dtype | None = None
) -> list[KVLayer]:
    """The KV allocation items of a ``Transformer``, one per layer, for blocks of ``block_size``
    with full-precision KV in ``dtype`` (default: the model's)."""
    cfg = model.config
    kv_dtype = dtype if dtype is not None else model.dtype
    return [
        KVLayer(kv_layer_name(i), block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        for i in range(cfg.num_layers)
    ]


@dataclass
class KVPlan:
    """KV precision per layer entry (``layers.{i}.kv``); layers absent use ``default``."""

    layers: dict[str, str] = field(default_factory=dict)
    default: str = "auto"
    notes: dict = field(default_factory=dict)

    def layer_dtypes(self, num_layers: int, source: str = "kv plan") -> list[str]:
        """The precision of each of ``num_layers`` layers; a ConfigError names entries the model
        does not have."""
        known = {kv_layer_name(i) for i in range(num_layers)}
        missing = sorted(set(self.layers) - known)
        if missing:
            raise ConfigError(
                f"{source} names KV layers the model does not have: {', '.join(missing)}",
                hint=f"the model has layers.0.kv ... layers.{num_layers - 1}.kv",
            )
        return [self.layers.get(kv_layer_name(i), self.default) for i in range(num_layers)]

    def to_dict(self, num_layers: int | None = None) -> dict:
        layers = (
            {kv_layer_name(i): d for i, d in enumerate(self.layer_dtypes(num_layers))}
            if num_layers is not None
            else dict(self.layers)
        )
        doc: dict = {"default": self.default, "layers": layers}
        if self.notes:
            doc["notes"] = self.notes
        return doc

    @classmethod
    def from_dict(cls, doc: object, source: str) -> KVPlan:
        """Parse a plan's ``kv`` section; a ConfigError names the key and the allowed values."""
        if not isinstance(doc, dict):
            raise ConfigError(f"{source}: kv must be a mapping", hint="kv: {default: int4, layers: {...}}")
        unknown = set(doc) - {"default", "layers", "notes"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown keys kv.{sorted(unknown)}", hint="allowed: default, layers, notes"
            )
        allowed = ", ".join(LAYER_KV_DTYPES)
        default = str(doc.get("default", "auto"))
        if default not in LAYER_KV_DTYPES:
            raise ConfigError(f"{source}: kv.default is {default!r}", hint=f"allowed: {allowed}")
        layers = doc.get("layers") or {}
        if not isinstance(layers, dict):
            raise ConfigError(f"{source}: kv.layers must be a mapping", hint="e.g. layers.0.kv: int8")
        entries = {}
        for name, value in layers.items():
            parts = str(name).split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] != "kv":
                raise ConfigError(
                    f"{source}: kv.layers.{name} is not a KV layer", hint="name them layers.{i}.kv"
                )
            if str(value) not in LAYER_KV_DTYPES:
                raise ConfigError(f"{source}: kv.layers.{name} is {value!r}", hint=f"allowed: {allowed}")
            entries[str(name)] = str(value)
        return cls(entries, default, dict(doc.get("notes") or {}))


@dataclass
class QuantPlan:
    """Scheme name per group name. Groups absent from ``schemes`` use ``default``. ``kv``: the
    KV precision per layer, when the plan carries one."""

    schemes: dict[str, str] = field(default_factory=dict)
    default: str = "none"
    notes: dict = field(default_factory=dict)
    kv: KVPlan | None = None

    def scheme_for(self, group: str) -> QuantScheme:
        return parse_scheme(self.schemes.get(group, self.default))

    def resolved(self, groups: list[WeightGroup]) -> dict[str, str]:
        """Explicit scheme name for every group of a model (after validation)."""
        self.validate(groups)
        return {g.name: self.schemes.get(g.name, self.default) for g in groups}

    def validate(self, groups: list[WeightGroup]) -> None:
        """Refuse unknown group names and schemes that do not fit; the message lists them all."""
        known = {g.name: g for g in groups}
        missing = sorted(set(self.schemes) - set(known))
        if missing:
            raise ConfigError(
                f"quantisation plan names groups the model does not have: {', '.join(missing)}",
                hint=f"the model has {len(known)} groups, e.g. layers.0.qkv ... "
                f"layers.{len(known) // 4 - 1}.down, lm_head",
            )
        parse_scheme(self.default)
        bad = [
            f"{g.name}={self.schemes.get(g.name, self.default)}"
            for g in groups
            if not g.allowed(parse_scheme(self.schemes.get(g.name, self.default)))
        ]
        if bad:
            raise ConfigError(
                f"quantisation schemes that do not fit their matrices: {', '.join(bad)}",
                hint="int4 needs in_features divisible by the group size; pick a smaller group",
            )

    def to_yaml(self, groups: list[WeightGroup] | None = None, num_layers: int | None = None) -> str:
        """The plan as YAML; with ``groups`` / ``num_layers``, every weight group / KV layer is
        listed explicitly (after validation)."""
        schemes = self.resolved(groups) if groups is not None else dict(self.schemes)
        doc: dict = {"format": PLAN_FORMAT, "default": self.default, "groups": schemes}
        if self.notes:
            doc["notes"] = self.notes
        if self.kv is not None:
            doc["kv"] = self.kv.to_dict(num_layers)
        return yaml.safe_dump(doc, sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str, source: str = "<plan>") -> QuantPlan:
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: invalid YAML: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ConfigError(
                f"{source} is not a quantisation plan", hint=f"expected 'format: {PLAN_FORMAT}'"
            )
        unknown = set(doc) - {"format", "default", "groups", "notes", "kv"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown keys {sorted(unknown)}",
                hint="allowed: format, default, groups, notes, kv",
            )
        schemes = {str(k): str(v) for k, v in (doc.get("groups") or {}).items()}
        for name in schemes.values():
            parse_scheme(name)
        kv = KVPlan.from_dict(doc["kv"], source) if "kv" in doc else None
        return cls(schemes, str(doc.get("default", "none")), dict(doc.get("notes") or {}), kv)

    def save(
        self, path: str | Path, groups: list[WeightGroup] | None = None, num_layers: int | None = None
    ) -> None:
        Path(path).write_text(self.to_yaml(groups, num_layers), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> QuantPlan:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read quantisation plan {path}: {exc}") from None
        return cls.from_yaml(text, str(path))


def plan_nbytes(schemes: dict[str, str], groups: list[WeightGroup]) -> int:
    """Resident bytes of all groups under a resolved plan."""
    return sum(parse_scheme(schemes[g.name]).nbytes(g.out_features, g.in_features) for g in groups)


def plan_bits_per_weight(schemes: dict[str, str], groups: list[WeightGroup]) -> float:
    """Average bits per weight over all groups, scales and zeros included."""
    return 8.0 * plan_nbytes(schemes, groups) / sum(g.numel for g in groups)


def warn_if_slow_activations(model: Transformer) -> None:
    """The weight-only kernels are slower than fp32 F.linear when fed fp32 activations on CPU,
    unless the fused kernels' int8-activation loops take them (``policy.int8_activations_fast``)."""
    from edge_rtgi.llm.quant.policy import int8_activations_fast

    if model.device.type != "cpu" or model.dtype != torch.float32 or int8_activations_fast():
        return
    if not cpu_has_bf16():
        log.warning(
            "this CPU has no native bf16: quantised layers run on the fp32 path. Weights "
            "still shrink, but int8/int4 matmuls with fp32 activations are slower than fp32."
        )
    else:
        log.warning(
            "quantised model runs with fp32 activations; load it with dtype bf16 (or auto) "
            "for the fast int8/int4 kernels"
        )


def float_linear(model: Transformer, group: WeightGroup) -> nn.Linear:
    """The float linear layer of ``group`` (TypeError where it is not one, e.g. quantised already:
    ``check_plan_inputs`` refuses such plans before any work)."""
    module = model.get_submodule(group.module_path)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{group.module_path} is a {type(module).__name__}, not a float nn.Linear")
    return module


def install_packed(model: Transformer, group: WeightGroup, packed: PackedWeight) -> None:
    """Swap one float linear for its kernel-backed quantised layer (frees the float weight)."""
    old = float_linear(model, group)
    new = make_quant_linear(packed, old.bias, model.dtype, model.device)
    parent_path, _, attr = group.module_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, new)
    if group.tied_embedding:
        model.embed_tokens = TiedQuantEmbedding(new)


def check_plan_inputs(
    model: Transformer, groups: list[WeightGroup], resolved: dict[str, str], importance: dict | None = None
) -> None:
    """Refuse, before any work, groups to quantise that are not float linears any more, or that
    ``importance`` (when given) does not cover."""
    planned = [g for g in groups if parse_scheme(resolved[g.name]).bits < 16]
    done = [g.name for g in planned if not isinstance(model.get_submodule(g.module_path), nn.Linear)]
    if done:
        raise ConfigError(
            f"{', '.join(done[:4])}{' ...' if len(done) > 4 else ''} already quantised",
            hint="apply a plan to a float model (load it again)",
        )
    missing = [g.name for g in planned if importance is not None and g.name not in importance]
    if missing:
        raise ConfigError(
            f"the importance has no entry for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}",
            hint="collect it on this model with edge_rtgi.llm.quant.profile.collect_importance",
        )


def apply_quant_plan(
    model: Transformer,
    plan: QuantPlan | str | Path,
    dtype: torch.dtype | None = None,
    importance: dict[str, torch.Tensor] | None = None,
    grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, str]:
    """Quantise ``model`` in place according to ``plan`` (a QuantPlan or a YAML path).

    Weights are quantised from the model's current precision; ``dtype``, when given, then moves
    the whole model (activations, scales, unquantised tensors) to that dtype, so an fp32 model
    can be quantised from its fp32 weights and run in bf16. ``importance`` (per group, from
    ``profile.collect_importance``) fits each grid to the activations it will see; without it
    grids span each group's range. ``grids`` (per group, int4 (scale, zero) [N, K/G]) puts a
    group's codes on a grid the model file already chose (``quantize_weight``'s ``grid``).
    Returns the resolved scheme per group. Groups planned as ``none`` are left untouched.
    """
    if not isinstance(plan, QuantPlan):
        plan = QuantPlan.load(plan)
    groups = model_groups(model)
    resolved = plan.resolved(groups)
    check_plan_inputs(model, groups, resolved, importance)
    for group in groups:
        scheme = parse_scheme(resolved[group.name])
        if scheme.bits < 16:
            weight = float_linear(model, group).weight
            weights = None if importance is None else importance[group.name]
            grid = (grids or {}).get(group.name)
            install_packed(model, group, quantize_weight(weight, scheme, weights, grid=grid))
    if dtype is not None:
        model.to(dtype)  # packed codes keep their integer dtypes; bf16 scales convert exactly
    warn_if_slow_activations(model)
    return resolved


def uniform_plan(groups: list[WeightGroup], scheme_name: str) -> QuantPlan:
    """One scheme everywhere. Where an int4 group size does not divide a matrix's input size,
    the largest group size that does is used instead (recorded in ``notes``)."""
    scheme = parse_scheme(scheme_name)
    schemes, fallbacks = {}, {}
    for g in groups:
        name = scheme.name
        if scheme.bits == 4 and not g.allowed(scheme):
            prefix = "int4sym" if scheme.symmetric else "int4"
            fitting = [
                s for s in (128, 64, 32) if s < scheme.group and g.allowed(parse_scheme(f"{prefix}-g{s}"))
            ]
            name = f"{prefix}-g{fitting[0]}" if fitting else "int8"
            fallbacks[g.name] = name
        schemes[g.name] = name
    notes = {"uniform": scheme.name}
    if fallbacks:
        notes["fallbacks"] = f"{len(fallbacks)} groups use a smaller group (input size not divisible)"
    return QuantPlan(schemes, "none", notes)
