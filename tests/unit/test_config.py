"""Strict YAML config loading and the device/dtype policy."""

from dataclasses import dataclass, field

import pytest

from edge_rtgi.config import from_dict, load_config, parse_yaml
from edge_rtgi.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    rate_hz: int = 16000
    name: str = "x"


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    items: tuple[Inner, ...] = ()
    gain: float = 1.0
    label: str | None = None

    def __post_init__(self):
        if self.gain < 0:
            raise ValueError("gain must be >= 0")


def test_nested_values_and_lists_are_built():
    cfg = from_dict(Outer, parse_yaml("inner:\n  rate_hz: 8000\nitems:\n  - name: a\n  - name: b\ngain: 2\n"))
    assert cfg.inner.rate_hz == 8000
    assert [i.name for i in cfg.items] == ["a", "b"]
    assert cfg.gain == 2.0 and isinstance(cfg.gain, float)


def test_unknown_key_names_file_line_and_allowed_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gain: 1\ninner:\n  rate_hz: 1\n  rate: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(Outer, path)
    msg = str(info.value)
    assert f"{path}:4" in msg and "'rate'" in msg and "rate_hz" in msg
    assert msg.count(str(path)) == 1  # the location is named once, not repeated per nesting level


def test_wrong_type_and_validation_errors_are_config_errors():
    with pytest.raises(ConfigError, match=r"<s>:2: Outer.inner.rate_hz: expected int"):
        from_dict(Outer, parse_yaml("inner:\n  rate_hz: fast\n", "<s>"))
    with pytest.raises(ConfigError, match="gain must be >= 0"):
        from_dict(Outer, parse_yaml("gain: -1\n"))
    with pytest.raises(ConfigError, match="expected int"):
        from_dict(Inner, parse_yaml("rate_hz: true\n"))


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"bad.yaml:2: invalid YAML"):
        parse_yaml("a: 1\n b: [\n", "bad.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Outer, tmp_path / "nope.yaml")


def test_dtype_policy():
    import torch

    from edge_rtgi.device import cpu_has_bf16, resolve_device, resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) == torch.float32
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("int3", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_weight_quant_policy(monkeypatch):
    """quant: auto means int8 weights only where they are the fast path: a CPU running bf16, or
    any CPU whose fused kernels round int4 layers' activations to int8 (AVX2 or AVX-512 VNNI)."""
    import torch

    from edge_rtgi import device as dev
    from edge_rtgi.llm.quant import policy

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(dev, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(policy, "int8_activations_fast", lambda: False)
    assert policy.resolve_weight_quant("auto", cpu, torch.bfloat16) == "int8"
    assert policy.resolve_weight_quant("auto", cpu, torch.float32) is None  # int8 kernel is slow with fp32 x
    assert policy.resolve_weight_quant("auto", cuda, torch.bfloat16) is None
    assert policy.resolve_weight_quant("none", cpu, torch.bfloat16) is None
    assert policy.resolve_weight_quant(None, cpu, torch.bfloat16) is None
    assert policy.resolve_weight_quant("int4-g64", cpu, torch.float32) == "int4-g64"
    monkeypatch.setattr(dev, "cpu_has_bf16", lambda: False)  # bf16 requested on a CPU that emulates it
    assert policy.resolve_weight_quant("auto", cpu, torch.bfloat16) is None
    # an AVX2 CPU (no native bf16: fp32 activations) with the kernels' int8-activation loops
    monkeypatch.setattr(policy, "int8_activations_fast", lambda: True)
    assert policy.resolve_weight_quant("auto", cpu, torch.float32) == "int8"
    assert policy.resolve_weight_quant("auto", cpu, torch.bfloat16) == "int8"
    assert policy.resolve_weight_quant("auto", cuda, torch.float32) is None
    assert policy.resolve_weight_quant("auto", cpu, torch.float64) is None


def test_the_daemons_engine_speculates_by_default_with_or_without_an_engine_section(tmp_path):
    """The daemon's engine runs ``speculative: auto`` unless its config says otherwise; an engine
    section that names other keys keeps that default (it is loaded as the daemon's engine config,
    the class its default is built with); the library's EngineConfig stays ``off``. kv_dtype int4
    with it is a config error naming the keys."""
    from edge_rtgi.llm.engine_config import EngineConfig
    from edge_rtgi.server.config import DaemonConfig, DaemonEngineConfig, load_daemon_config

    assert EngineConfig().speculative == "off"
    assert load_daemon_config(None).engine.speculative == "auto"
    path = tmp_path / "d.yaml"
    path.write_text("engine:\n  kv_cache_memory_mb: 64\n")
    cfg = load_daemon_config(path)
    assert isinstance(cfg.engine, DaemonEngineConfig) and cfg.engine.speculative == "auto"
    assert cfg.engine.kv_cache_memory_mb == 64
    path.write_text('engine:\n  speculative: "off"\n')
    assert load_daemon_config(path).engine.speculative == "off"
    path.write_text("engine:\n  # every key commented out\n")  # an empty section: the defaults
    assert load_daemon_config(path).engine.speculative == "auto"
    with pytest.raises(ConfigError, match="kv_dtype: int4 yet .*the daemon's engine speculates by default"):
        from_dict(DaemonConfig, {"engine": {"kv_dtype": "int4"}})
    eviction = {"kv_budget_tokens": 512, "kv_eviction": {"mode": "h2o"}}
    with pytest.raises(ConfigError, match="speculative yet.*set speculative: off"):
        from_dict(DaemonConfig, {"engine": eviction})
    plain = from_dict(DaemonConfig, {"engine": {**eviction, "speculative": "off"}})
    assert plain.engine.kv_budget_tokens == 512
