"""KV precision per layer without a model: the mixed store against the uniform ones on fresh random
data, the plan format, the allocator on a synthetic profile, and bad plans and settings."""

from __future__ import annotations

import pytest
import torch

from edge_rtgi.config import from_dict
from edge_rtgi.errors import ConfigError
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.kv.int4 import Int4KIVIPagedKVStorage
from edge_rtgi.llm.kv.mixed import MixedPagedKVStorage, mixed_bytes_per_block
from edge_rtgi.llm.kv.storage import Int8PagedKVStorage, PagedKVStorage
from edge_rtgi.llm.quant.allocate import Budget, allocate_kv
from edge_rtgi.llm.quant.plan import KVLayer, KVPlan, QuantPlan, kv_layer_name
from edge_rtgi.llm.quant.profile import SensitivityTable

BLOCKS, BS, H, D = 6, 4, 2, 32
UNIFORM = {"auto": PagedKVStorage, "int8": Int8PagedKVStorage, "int4": Int4KIVIPagedKVStorage}


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def test_mixed_store_writes_and_gathers_each_layer_as_its_uniform_store():
    """Layer i of a mixed store holds exactly what a uniform store of its precision holds, through
    steps that fill, leave open and reuse blocks, and a compaction; on fresh random data each run."""
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    plan = ["int4", "auto", "int8", "int4", "auto"]
    mixed = MixedPagedKVStorage(plan, BLOCKS, BS, H, D, torch.float32)
    uniform = {name: cls(len(plan), BLOCKS, BS, H, D, torch.float32) for name, cls in UNIFORM.items()}
    steps = [torch.arange(0, 6), torch.tensor([6]), torch.arange(7, 13), torch.tensor([13])]
    for slots in steps:
        for layer in range(len(plan)):
            k = torch.randn(len(slots), H, D, generator=gen)
            v = torch.randn(len(slots), H, D, generator=gen)
            mixed.write(layer, slots, k, v)
            uniform[plan[layer]].write(layer, slots, k, v)
    # survivors packed into blocks 0-2: a closed block moved whole, others re-quantised, an open tail
    src, dst = torch.tensor([8, 9, 10, 11, 13]), torch.tensor([4, 5, 6, 7, 8])
    mixed.apply_compaction(src, dst, [0, 1, 2], 9)
    for store in uniform.values():
        store.apply_compaction(src, dst, [0, 1, 2], 9)
    every = torch.arange(9)
    for layer, name in enumerate(plan):
        got, want = mixed.gather(layer, every), uniform[name].gather(layer, every)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer} seed {seed}"
        assert mixed.k[layer].dtype == uniform[name].k[layer].dtype  # int layers never look plain
        part, index = mixed.part_of(layer)
        assert type(part) is UNIFORM[name] and part.k[index] is mixed.k[layer]


def test_mixed_bytes_per_block_sums_the_layers():
    args = (BS, H, D, torch.bfloat16)
    for name, cls in UNIFORM.items():
        assert mixed_bytes_per_block([name] * 5, *args) == cls.bytes_per_block(5, *args)
    plan = ["int4", "auto", "int8", "int4", "auto"]
    assert mixed_bytes_per_block(plan, *args) == (
        2 * PagedKVStorage.bytes_per_block(1, *args)
        + Int8PagedKVStorage.bytes_per_block(1, *args)
        + 2 * Int4KIVIPagedKVStorage.bytes_per_block(1, *args)
    )
    # int8 counts its fp32 scale per slot and head: what the store really allocates
    store = Int8PagedKVStorage(3, 2, BS, H, D, torch.bfloat16)
    held = sum(t.numel() * t.element_size() for ts in store._per_slot() for t in ts)
    assert held == 2 * Int8PagedKVStorage.bytes_per_block(3, *args)


def _layers(n: int) -> list[KVLayer]:
    return [KVLayer(kv_layer_name(i), 16, 3, 64, torch.bfloat16) for i in range(n)]


def test_allocator_keeps_the_most_sensitive_layer_precise():
    layers = _layers(4)
    kl = {
        kv_layer_name(0): {"int8": 0.001, "int4": 0.01},
        kv_layer_name(1): {"int8": 0.3, "int4": 0.9},  # the sensitive one, even at int8
        kv_layer_name(2): {"int8": 0.002, "int4": 0.02},
        kv_layer_name(3): {"int8": 0.001, "int4": 0.015},
    }
    table = SensitivityTable(kl, {name: (3, 64) for name in kl})
    per = {d: layers[0].option_nbytes(d) or 0 for d in ("auto", "int8", "int4")}
    numel = sum(kv.numel for kv in layers)
    # room for one layer above int4: at int8, not at full precision
    bits = 8 * (3 * per["int4"] + per["int8"]) / numel
    plan = allocate_kv(layers, table, Budget.from_args(layers, bits, None, flag="--target-kv-bits"))
    assert plan.layer_dtypes(4) == ["int4", "int8", "int4", "int4"]
    # room for that layer in full precision: it takes it, rather than int8 there and elsewhere
    bits = 8 * (3 * per["int4"] + per["auto"]) / numel
    plan = allocate_kv(layers, table, Budget.from_args(layers, bits, None, flag="--target-kv-bits"))
    assert plan.layer_dtypes(4)[1] == "auto" and plan.notes["kv_bits"] <= bits
    # schemes limit the candidates: without int8 the tight budget leaves every layer int4
    tight = 8 * (3 * per["int4"] + per["int8"]) / numel
    plan = allocate_kv(
        layers, table, Budget.from_args(layers, tight, None, flag="--target-kv-bits"), ("auto", "int4")
    )
    assert plan.layer_dtypes(4) == ["int4"] * 4
    with pytest.raises(ConfigError, match="--target-kv-bits >= 5.5"):
        allocate_kv(layers, table, Budget.from_args(layers, 3.0, None, flag="--target-kv-bits"))
    with pytest.raises(ConfigError, match="no row for layers.0.kv"):
        allocate_kv(
            layers, SensitivityTable({}, {}), Budget.from_args(layers, 8.0, None, flag="--target-kv-bits")
        )


def test_plan_kv_section_round_trips(tmp_path):
    plan = QuantPlan(
        {"lm_head": "int8"}, "none", {}, KVPlan({"layers.1.kv": "int8"}, "int4", {"kv_bits": 6.0})
    )
    path = tmp_path / "plan.yaml"
    plan.save(path, num_layers=3)
    loaded = QuantPlan.load(path)
    assert loaded.schemes == {"lm_head": "int8"}
    assert loaded.kv is not None and loaded.kv.layer_dtypes(3) == ["int4", "int8", "int4"]
    assert loaded.kv.notes == {"kv_bits": 6.0}
    assert QuantPlan.from_yaml("format: edge-rtgi-quant-plan/1\ngroups: {}\n").kv is None


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ("{layers: {layers.1.kv: int2}}", r"kv.layers.layers.1.kv is 'int2'.*allowed: auto, int8, int4"),
        ("{default: fp8}", r"kv.default is 'fp8'.*allowed: auto, int8, int4"),
        ("{layers: {layer1: int8}}", r"kv.layers.layer1 is not a KV layer.*layers.\{i\}.kv"),
        ("{layer: {}}", r"unknown keys kv.\['layer'\].*allowed: default, layers, notes"),
        ("int4", "kv must be a mapping"),
    ],
)
def test_bad_kv_sections_are_refused(kv, message):
    with pytest.raises(ConfigError, match=message):
        QuantPlan.from_yaml(f"format: edge-rtgi-quant-plan/1\nkv: {kv}\n", "p.yaml")


def test_a_plan_for_more_layers_than_the_model_is_refused():
    with pytest.raises(ConfigError, match=r"layers.7.kv.*layers.0.kv ... layers.3.kv"):
        KVPlan({"layers.7.kv": "int8"}).layer_dtypes(4)


def _plan_file(tmp_path, text: str) -> str:
    path = tmp_path / f"kv{len(list(tmp_path.iterdir()))}.yaml"  # a new file each call
    path.write_text("format: edge-rtgi-quant-plan/1\n" + text)
    return str(path)


def test_engine_settings_for_kv_plans(tmp_path):
    good = _plan_file(tmp_path, "kv: {default: int8, layers: {layers.0.kv: int4}}\n")
    cfg = EngineConfig(kv_dtype="plan", kv_plan=good)
    assert cfg.kv_layer_dtypes(3) == ["int4", "int8", "int8"]
    with pytest.raises(ValueError, match="kv_dtype: plan and kv_plan go together"):
        EngineConfig(kv_dtype="plan")
    with pytest.raises(ValueError, match="kv_dtype: plan and kv_plan go together"):
        EngineConfig(kv_plan=good)
    with pytest.raises(ValueError, match="has no kv section"):
        EngineConfig(kv_dtype="plan", kv_plan=_plan_file(tmp_path, "groups: {}\n"))
    with pytest.raises(ValueError, match="kv_plan: cannot read"):
        EngineConfig(kv_dtype="plan", kv_plan=str(tmp_path / "missing.yaml"))
    with pytest.raises(
        ValueError, match="does not work with a KV plan with int4 layers.*set speculative: off"
    ):
        EngineConfig(kv_dtype="plan", kv_plan=good, speculative={"draft": "ngram", "k": 4})
    int8_only = _plan_file(tmp_path, "kv: {default: int8}\n")
    EngineConfig(kv_dtype="plan", kv_plan=int8_only, speculative={"draft": "ngram", "k": 4})
    with pytest.raises(ValueError, match=r"layers.5.kv"):
        EngineConfig(
            kv_dtype="plan", kv_plan=_plan_file(tmp_path, "kv: {layers: {layers.5.kv: int8}}\n")
        ).kv_layer_dtypes(3)
    # from YAML: a config error naming the key and the allowed values
    bad = _plan_file(tmp_path, "kv: {layers: {layers.0.kv: int3}}\n")
    with pytest.raises(
        ConfigError, match=r"kv_plan: .*kv.layers.layers.0.kv is 'int3'.*allowed: auto, int8, int4"
    ):
        from_dict(EngineConfig, {"kv_dtype": "plan", "kv_plan": bad})
    with pytest.raises(ConfigError, match=r"kv_dtype must be one of \('auto', 'int8', 'int4', 'plan'\)"):
        from_dict(EngineConfig, {"kv_dtype": "int2"})


def test_a_plan_with_int4_refuses_single_token_moves_before_moving_anything():
    """int4 keys share per-block scales, so ``copy_slots`` is refused; the other layers' stores
    must not have moved first (a half-moved cache)."""
    mixed = MixedPagedKVStorage(["auto", "int8", "int4"], BLOCKS, BS, H, D, torch.float32)
    slots = torch.arange(0, 8)
    for layer in range(3):
        mixed.write(layer, slots, torch.randn(8, H, D), torch.randn(8, H, D))
    before = [mixed.gather(layer, slots) for layer in range(3)]
    with pytest.raises(RuntimeError, match="int4 KV moves tokens only through apply_compaction"):
        mixed.copy_slots(torch.tensor([5]), torch.tensor([1]))
    for layer in range(3):
        for got, want in zip(mixed.gather(layer, slots), before[layer], strict=True):
            assert torch.equal(got, want)
    # without int4 the moves happen
    plain = MixedPagedKVStorage(["auto", "int8"], BLOCKS, BS, H, D, torch.float32)
    for layer in range(2):
        plain.write(layer, slots, torch.randn(8, H, D), torch.randn(8, H, D))
    plain.copy_slots(torch.tensor([5]), torch.tensor([1]))
    for layer in range(2):
        keys, _ = plain.gather(layer, slots)
        assert torch.equal(keys[1], keys[5])
