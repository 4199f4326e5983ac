"""Quality of a quantised model against the full model, and the ``--report`` directory.

Measured on the evaluation text ``edge_rtgi/bench/data/quant_eval.txt`` (about 7,300 tokens
written for the project; never used for profiling):

- mean KL(full || quantised) of next-token distributions, teacher-forced over the whole text,
  and both perplexities, with a bootstrap interval of the KL over 256-token windows;
- next-token agreement: how often the two models' top-1 predictions coincide;
- quality retention, the benchmark's definition (``edge_rtgi.scoring.retention.score_outputs``):
  optimised score / full score, capped at 1, where the score is the corpus chrF of greedy
  continuations of evenly spaced prompts against the text's true continuation, with a paired
  bootstrap interval over prompts (``retention_interval``). The chrF agreement between the two
  models' continuations is reported too.

"Full model" is the same weights in fp32 on the plain path, as the benchmark defines it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_rtgi.llm.model import ContiguousKVCache, Transformer
from edge_rtgi.llm.quant.plan import GROUP_KINDS, WeightGroup, plan_nbytes
from edge_rtgi.llm.quant.schemes import parse_scheme
from edge_rtgi.scoring.retention import (
    bootstrap_mean_interval,
    retention_interval,
    retention_ratio,
    score_outputs,
)


@torch.no_grad()
def window_logits(model: Transformer, ids: Tensor) -> Tensor:
    """Logits [T, vocab] (fp32) for one window of token ids, from a fresh contiguous cache."""
    cache = ContiguousKVCache(model.config, len(ids), model.dtype, model.device)
    cache.begin(len(ids))
    return model.compute_logits(
        model(ids.to(model.device), torch.arange(len(ids), device=model.device), cache)
    )


@torch.no_grad()
def greedy_continuation(model: Transformer, prompt: Tensor, new_tokens: int) -> list[int]:
    """Greedy decode of ``new_tokens`` after ``prompt`` (contiguous cache, batch 1)."""
    cache = ContiguousKVCache(model.config, len(prompt) + new_tokens, model.dtype, model.device)
    ids, positions = prompt.to(model.device), torch.arange(len(prompt), device=model.device)
    out: list[int] = []
    for _ in range(new_tokens):
        cache.begin(len(ids))
        logits = model.compute_logits(model(ids, positions, cache)[-1:])
        cache.commit()
        token = int(logits.argmax(-1))
        out.append(token)
        ids = torch.tensor([token], device=model.device)
        positions = torch.tensor([cache.length], device=model.device)
    return out


def looping_share(continuations: list[list[int]], ngram: int = 4, repeated_fraction: float = 0.25) -> float:
    """Share of token sequences in which at least ``repeated_fraction`` of the ``ngram``-grams repeat
    an earlier one of the same sequence: a greedy decode caught in a loop. The evaluation decodes
    past EOS, so a run of end-of-text or newline tokens counts as a loop too."""

    def looping(tokens: list[int]) -> bool:
        grams = [tuple(tokens[i : i + ngram]) for i in range(len(tokens) - ngram + 1)]
        return bool(grams) and len(grams) - len(set(grams)) >= repeated_fraction * len(grams)

    return sum(map(looping, continuations)) / len(continuations) if continuations else 0.0


class BatchKVCache:
    """Keys and values of ``batch`` equal-length sequences that advance in lockstep.

    The model's flat token axis holds the sequences back to back ([B * T] rows, sequence-major),
    so one forward pass serves all of them; attention is per sequence, causal within the new
    tokens. Used to decode many evaluation prompts at once: the batch costs little more per step
    than one sequence on a memory-bound CPU.
    """

    def __init__(self, cfg, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.length, self.new = batch, 0, 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [B*T, Hq, D], k/v: [B*T, Hkv, D] -> [B*T, Hq, D]
        B, T = self.batch, self.new
        start, end = self.length, self.length + T
        self.k[layer, :, start:end] = k.view(B, T, *k.shape[1:])
        self.v[layer, :, start:end] = v.view(B, T, *v.shape[1:])
        keys, values = self.k[layer, :, :end].transpose(1, 2), self.v[layer, :, :end].transpose(1, 2)
        mask = None
        if T > 1:
            mask = (
                torch.arange(end, device=q.device)[None, :]
                <= torch.arange(start, end, device=q.device)[:, None]
            )
        out = F.scaled_dot_product_attention(
            q.view(B, T, *q.shape[1:]).transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2).reshape(B * T, *q.shape[1:])


@torch.no_grad()
def greedy_continuations(model: Transformer, prompts: Tensor, new_tokens: int) -> list[list[int]]:
    """Greedy decode of ``new_tokens`` after each row of ``prompts`` [B, P], all rows as one batch."""
    B, P = prompts.shape
    cache = BatchKVCache(model.config, B, P + new_tokens, model.dtype, model.device)
    ids, out = prompts.to(model.device), []
    for _ in range(new_tokens):
        T = ids.shape[1]
        cache.new = T
        positions = torch.arange(cache.length, cache.length + T, device=model.device).repeat(B)
        hidden = model(ids.reshape(-1), positions, cache).view(B, T, -1)[:, -1].contiguous()
        cache.length += T
        ids = model.compute_logits(hidden).argmax(-1)[:, None]  # [B, 1]
        out.append(ids[:, 0])
    return torch.stack(out, 1).tolist()


@dataclass
class QualityResult:
    """Quantised vs full model on the evaluation text; intervals are 95 % paired-bootstrap ones."""

    mean_kl: float
    perplexity_full: float
    perplexity_quant: float
    next_token_agreement: float
    chrf_full: float
    chrf_quant: float
    chrf_agreement: float
    quality_retention: float
    tokens: int
    prompts: int
    new_tokens: int = 0
    kl_low: float = math.nan  # interval of mean_kl, resampling whole windows
    kl_high: float = math.nan
    retention_uncapped: float = math.nan  # chrF ratio without the cap at 1
    retention_low: float = math.nan  # interval of quality_retention, resampling prompts
    retention_high: float = math.nan
    retention_std: float = math.nan
    window_kl_sums: list[float] = field(default_factory=list)  # per window: summed KL, for paired comparisons
    window_tokens: list[int] = field(default_factory=list)
    # Teacher-forced on the true text: the share of positions whose top-1 prediction is the true
    # next token. A second view of retention (their ratio), free of the compounding that a greedy
    # continuation suffers once it leaves the full model's path; not the benchmark's definition.
    token_accuracy_full: float = math.nan
    token_accuracy_quant: float = math.nan
    token_accuracy_ratio_low: float = math.nan  # 95 % interval of the ratio (uncapped), resampling windows
    token_accuracy_ratio_high: float = math.nan
    prompt_stride_tokens: int = 0  # tokens between consecutive evaluation prompts' starts
    bootstrap_block_prompts: int = 1  # consecutive prompts the retention interval resamples together
    # Share of greedy continuations stuck in a loop (``looping_share``): what most of a chrF drop
    # is made of on a small model, whose greedy decoding loops easily.
    looping_share_full: float = math.nan
    looping_share_quant: float = math.nan

    @property
    def token_accuracy_retention(self) -> float:
        """token_accuracy_quant / token_accuracy_full, capped at 1 like ``quality_retention``."""
        return retention_ratio(self.token_accuracy_quant, self.token_accuracy_full)


@dataclass
class _WindowSums:
    """Per window of the text, summed over its positions: KL(full || quant), each model's NLL of the
    true next token, top-1 agreement between the models and each model's top-1 hits; and its tokens."""

    kl: list[float] = field(default_factory=list)
    nll_f: list[float] = field(default_factory=list)
    nll_q: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    hit_f: list[float] = field(default_factory=list)
    hit_q: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)


def _teacher_forced(
    full: Transformer, quant: Transformer, ids: Tensor, window_tokens: int, cache: dict
) -> _WindowSums:
    """KL, NLLs and top-1 agreement over non-overlapping windows of ``ids``, summed per window."""
    out = _WindowSums()
    for start in range(0, len(ids) - 1, window_tokens):
        window = ids[start : start + window_tokens + 1]
        if len(window) < 2:
            break
        if ("logits", start) not in cache:
            cache[("logits", start)] = window_logits(full, window[:-1])
        lf, lq = cache[("logits", start)], window_logits(quant, window[:-1])
        logp, logq = F.log_softmax(lf, -1), F.log_softmax(lq, -1)
        target = window[1:].to(lf.device)
        out.kl.append(float((logp.exp() * (logp - logq)).sum()))
        out.nll_f.append(-float(logp.gather(1, target[:, None]).sum()))
        out.nll_q.append(-float(logq.gather(1, target[:, None]).sum()))
        out.agree.append(float((lf.argmax(-1) == lq.argmax(-1)).sum()))
        out.hit_f.append(float((lf.argmax(-1) == target).sum()))
        out.hit_q.append(float((lq.argmax(-1) == target).sum()))
        out.count.append(len(target))
    return out


@torch.no_grad()
def compare_quality(
    full: Transformer,
    quant: Transformer,
    tokenizer,
    text: str | None = None,
    window_tokens: int = 256,
    prompt_tokens: int = 64,
    new_tokens: int = 48,
    max_prompts: int = 64,
    full_cache: dict | None = None,
    resamples: int = 2000,
) -> QualityResult:
    """Every number in ``QualityResult`` for ``quant`` against ``full`` on ``text``.

    ``text`` defaults to the evaluation text (``calibration_text("eval")``, ~7,300 tokens, never
    used for profiling). Prompts are ``max_prompts`` evenly spaced ``prompt_tokens``-token
    slices of it; each model continues them greedily for ``new_tokens`` tokens, all prompts as
    one batch (``greedy_continuations``), as the engine serves concurrent requests. When there
    are more prompts than the text has room for side by side, they overlap (the stride is less
    than ``prompt_tokens + new_tokens``), and the retention interval resamples runs of prompts
    that together span two prompts and their continuations (``block_prompts``), so that
    neighbours sharing text do not count as independent evidence.
    ``full_cache``: a dict reused across calls with the same ``full``/``text``, so comparing several
    quantised models runs the full model once.
    """
    from edge_rtgi.llm.quant.profile import calibration_text

    cache = full_cache if full_cache is not None else {}
    text = calibration_text("eval") if text is None else text
    ids = torch.tensor(list(getattr(tokenizer.encode(text), "ids", tokenizer.encode(text))))
    tf = _teacher_forced(full, quant, ids, window_tokens, cache)
    count = sum(tf.count)
    if max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    span = prompt_tokens + new_tokens
    stride = max(1, (len(ids) - span) // max_prompts)
    starts = list(range(0, len(ids) - span + 1, stride))[:max_prompts]
    # Overlapping prompts are resampled in runs of twice the overlap range: a simulation in which
    # prompts share noise only through shared tokens gave a bootstrap sd of 0.80 of the true one
    # with runs of ceil(span / stride) prompts, 0.92 with twice that; real text is also correlated
    # beyond the overlap (topics), so the longer run is the safer one.
    block_prompts = 1 if stride >= span else 2 * -(-span // stride)
    prompts = torch.stack([ids[s : s + prompt_tokens] for s in starts])
    truths = [
        tokenizer.decode(ids[s + prompt_tokens : s + prompt_tokens + new_tokens].tolist()) for s in starts
    ]
    key = ("continuations", tuple(starts), prompt_tokens, new_tokens)
    if key not in cache:
        cache[key] = greedy_continuations(full, prompts, new_tokens)
    ids_f, ids_q = cache[key], greedy_continuations(quant, prompts, new_tokens)
    texts_f, texts_q = [tokenizer.decode(c) for c in ids_f], [tokenizer.decode(c) for c in ids_q]
    scored = score_outputs("quant-eval", texts_q, texts_f, references=truths)
    interval = retention_interval(texts_q, texts_f, truths, resamples=resamples, block_prompts=block_prompts)
    kl_low, kl_high = bootstrap_mean_interval(tf.kl, tf.count, resamples=resamples)
    if scored.chrf_ref_full is None or scored.chrf_ref_optimised is None:  # truths has no None
        raise RuntimeError("score_outputs gave no chrF against the true continuations")
    return QualityResult(
        sum(tf.kl) / count,
        math.exp(sum(tf.nll_f) / count),
        math.exp(sum(tf.nll_q) / count),
        sum(tf.agree) / count,
        scored.chrf_ref_full,
        scored.chrf_ref_optimised,
        scored.chrf_agreement,
        scored.retention,
        count,
        len(truths),
        new_tokens,
        kl_low,
        kl_high,
        interval.uncapped,
        interval.low,
        interval.high,
        interval.std,
        [round(v, 6) for v in tf.kl],
        tf.count,
        sum(tf.hit_f) / count,
        sum(tf.hit_q) / count,
        *bootstrap_mean_interval(tf.hit_q, tf.hit_f, resamples=resamples),
        stride,
        block_prompts,
        looping_share(ids_f),
        looping_share(ids_q),
    )


def bits_table(resolved: dict[str, str], groups: list[WeightGroup]) -> str:
    """Markdown table: one row per layer, one column per kind, plus the LM head."""
    lines = ["| layer | " + " | ".join(GROUP_KINDS) + " |", "|---" * (len(GROUP_KINDS) + 1) + "|"]
    layers = sorted({int(g.name.split(".")[1]) for g in groups if g.name.startswith("layers.")})
    for i in layers:
        lines.append(f"| {i} | " + " | ".join(resolved[f"layers.{i}.{k}"] for k in GROUP_KINDS) + " |")
    lines.append(f"| lm_head | {resolved['lm_head']} |" + " |" * (len(GROUP_KINDS) - 1))
    return "\n".join(lines)


def bits_heatmap(resolved: dict[str, str], groups: list[WeightGroup], path: str | Path, title: str) -> None:
    """PNG heatmap of bits per weight (scales included), layers x kinds, scheme names in cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = {g.name: g for g in groups}
    layers = sorted({int(g.name.split(".")[1]) for g in groups if g.name.startswith("layers.")})
    grid = [
        [
            parse_scheme(resolved[f"layers.{i}.{k}"]).bits_per_weight(
                shape[f"layers.{i}.{k}"].out_features, shape[f"layers.{i}.{k}"].in_features
            )
            for k in GROUP_KINDS
        ]
        for i in layers
    ]
    fig, ax = plt.subplots(figsize=(5.5, 0.28 * len(layers) + 1.6))
    im = ax.imshow(
        grid,
        aspect="auto",
        cmap="viridis",
        vmin=4,
        vmax=16 if any(resolved[g.name] == "none" for g in groups) else 8.1,
    )
    for r, i in enumerate(layers):
        for c, k in enumerate(GROUP_KINDS):
            label = resolved[f"layers.{i}.{k}"].replace("int4sym-", "s").replace("int4-", "")
            ax.text(
                c,
                r,
                label,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if grid[r][c] < 6 else "black",
            )
    ax.set_xticks(range(len(GROUP_KINDS)), GROUP_KINDS)
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=6)
    ax.set_ylabel("layer")
    ax.set_title(f"{title}\nlm_head: {resolved['lm_head']}", fontsize=8)
    fig.colorbar(im, ax=ax, label="bits per weight (incl. scales)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class TaskRetentionLine:
    """One workload's task retention for the report (measured by ``edge_rtgi.bench.task_eval``,
    which the command that writes the report runs: this module stays below the benchmark)."""

    workload: str
    metric: str
    items: int
    full_score: float
    quantised_score: float
    retention: float
    low: float
    high: float


def write_report(
    out_dir: str | Path,
    resolved: dict[str, str],
    groups: list[WeightGroup],
    quality: QualityResult,
    model_name: str,
    full_weight_bytes: int,
    tasks: Sequence[TaskRetentionLine] = (),
) -> Path:
    """Write report.md, report.json and bits.png into ``out_dir``; returns the markdown path.

    ``tasks``: the quantised model's task retention per workload, the quality figure that accepts
    or refuses a plan; everything else in the report is a diagnostic beside it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    numel = sum(g.numel for g in groups)
    size = plan_nbytes(resolved, groups)
    summary = {
        "model": model_name,
        "bits_per_weight": round(8 * size / numel, 4),
        "quantised_groups_mb": round(size / 1e6, 3),
        "full_groups_mb_bf16": round(full_weight_bytes / 1e6, 3),
        **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(quality).items()},
        "token_accuracy_retention": round(quality.token_accuracy_retention, 6),
        "plan": resolved,
        "task_retention": [asdict(t) for t in tasks],
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    block = (
        f" in runs of {quality.bootstrap_block_prompts} (prompts {quality.prompt_stride_tokens} tokens apart "
        "overlap)"
        if quality.bootstrap_block_prompts > 1
        else ""
    )
    bits_heatmap(
        resolved, groups, out / "bits.png", f"{model_name}: {summary['bits_per_weight']} bits/weight"
    )
    md = [
        f"# Quantisation report: {model_name}",
        "",
        f"- average bits per weight (scales and zeros included): **{summary['bits_per_weight']}**",
        f"- quantised groups: {summary['quantised_groups_mb']} MB (the same groups in bf16: "
        f"{summary['full_groups_mb_bf16']} MB)",
        f"- evaluation text: {quality.tokens} tokens; mean KL(full || quantised) = {quality.mean_kl:.5f} "
        f"nats/token (95 % interval {quality.kl_low:.5f}-{quality.kl_high:.5f}, windows resampled)",
        f"- perplexity: full {quality.perplexity_full:.3f}, quantised {quality.perplexity_quant:.3f}",
        f"- next-token agreement with the full model: {100 * quality.next_token_agreement:.2f} %",
        f"- chrF of greedy continuations vs the true text ({quality.prompts} prompts x {quality.new_tokens} "
        "tokens): "
        f"full {quality.chrf_full:.2f}, quantised {quality.chrf_quant:.2f}; chrF agreement between the "
        f"two models' continuations {quality.chrf_agreement:.2f}",
        f"- continuation chrF ratio (fidelity, capped at 1): {100 * quality.quality_retention:.1f} % "
        f"(95 % paired-bootstrap interval over prompts{block} {100 * quality.retention_low:.1f}-"
        f"{100 * quality.retention_high:.1f} %; uncapped ratio {100 * quality.retention_uncapped:.1f} %)",
        f"- continuations caught in a loop (>= 25 % of their 4-grams repeated): full "
        f"{100 * quality.looping_share_full:.1f} %, quantised {100 * quality.looping_share_quant:.1f} %",
        "- next-token accuracy on the true text (teacher-forced): "
        f"full {100 * quality.token_accuracy_full:.2f} %, "
        f"quantised {100 * quality.token_accuracy_quant:.2f} %; ratio "
        f"{100 * quality.token_accuracy_retention:.1f} % (95 % interval over windows "
        f"{100 * quality.token_accuracy_ratio_low:.1f}-"
        f"{100 * quality.token_accuracy_ratio_high:.1f} %; not the "
        "benchmark's retention: no greedy compounding)",
        "",
        *_task_lines(tasks),
        "![bits per group](bits.png)",
        "",
        bits_table(resolved, groups),
        "",
    ]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    return out / "report.md"


def _task_lines(tasks: Sequence[TaskRetentionLine]) -> list[str]:
    if not tasks:
        return ["(task retention not measured: run without --task-items 0)", ""]
    rows = [
        f"| {t.workload} | {t.metric} | {t.items} | {t.full_score:.3f} | {t.quantised_score:.3f} "
        f"| **{100 * t.retention:.1f} %** [{100 * t.low:.1f}, {100 * t.high:.1f}] |"
        for t in tasks
    ]
    worst = min(tasks, key=lambda t: t.retention)
    return [
        "## Task retention (quality: quantised task score / full model's, same graded items)",
        "",
        "| workload | task score | items | full | quantised | retention [95 % CI] |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Lowest: {worst.workload} at {100 * worst.retention:.1f} %. Intervals: paired bootstrap over items.",
        "",
    ]
