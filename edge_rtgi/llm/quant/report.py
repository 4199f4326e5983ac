"""Quality of a quantised model against the full model, and the ``--report`` directory.

Measured on the held-out part of the calibration text (never used for profiling):

- mean KL(full || quantised) of next-token distributions, and both perplexities;
- next-token agreement: how often the two models' top-1 predictions coincide;
- quality retention, the benchmark's definition (``edge_rtgi.bench.quality.score_outputs``):
  optimised score / full score, capped at 1, where the score is the corpus chrF of greedy
  continuations of held-out prompts against the text's true continuation. The chrF agreement
  between the two models' continuations is reported too.

"Full model" is the same weights in fp32 on the plain path, as the benchmark defines it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_rtgi.bench.quality import score_outputs
from edge_rtgi.llm.model import ContiguousKVCache
from edge_rtgi.llm.quant.plan import GROUP_KINDS, WeightGroup, plan_nbytes
from edge_rtgi.llm.quant.schemes import parse_scheme


@torch.no_grad()
def window_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """Logits [T, vocab] (fp32) for one window of token ids, from a fresh contiguous cache."""
    cache = ContiguousKVCache(model.config, len(ids), model.dtype, model.device)
    cache.begin(len(ids))
    return model.compute_logits(model(ids.to(model.device), torch.arange(len(ids), device=model.device), cache))


@torch.no_grad()
def greedy_continuation(model: nn.Module, prompt: Tensor, new_tokens: int) -> list[int]:
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


@dataclass
class QualityResult:
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


@torch.no_grad()
def compare_quality(full: nn.Module, quant: nn.Module, tokenizer, text: str, window_tokens: int = 256,
                    prompt_tokens: int = 48, new_tokens: int = 24, max_prompts: int = 12,
                    full_cache: dict | None = None) -> QualityResult:
    """Every number in ``QualityResult`` for ``quant`` against ``full`` on ``text``.

    ``full_cache``: a dict reused across calls with the same ``full``/``text``, so comparing several
    quantised models runs the full model once.
    """
    cache = full_cache if full_cache is not None else {}
    ids = torch.tensor(list(getattr(tokenizer.encode(text), "ids", tokenizer.encode(text))))
    kl_sum = nll_f = nll_q = agree = 0.0
    count = 0
    for start in range(0, len(ids) - 1, window_tokens):
        window = ids[start:start + window_tokens + 1]
        if len(window) < 2:
            break
        if ("logits", start) not in cache:
            cache[("logits", start)] = window_logits(full, window[:-1])
        lf, lq = cache[("logits", start)], window_logits(quant, window[:-1])
        logp, logq = F.log_softmax(lf, -1), F.log_softmax(lq, -1)
        target = window[1:].to(lf.device)
        kl_sum += float((logp.exp() * (logp - logq)).sum())
        nll_f -= float(logp.gather(1, target[:, None]).sum())
        nll_q -= float(logq.gather(1, target[:, None]).sum())
        agree += float((lf.argmax(-1) == lq.argmax(-1)).sum())
        count += len(target)
    stride = max(1, (len(ids) - prompt_tokens - new_tokens) // max_prompts)
    texts_f, texts_q, truths = [], [], []
    for start in range(0, len(ids) - prompt_tokens - new_tokens + 1, stride)[:max_prompts]:
        prompt = ids[start:start + prompt_tokens]
        truths.append(tokenizer.decode(ids[start + prompt_tokens:start + prompt_tokens + new_tokens].tolist()))
        if ("text", start) not in cache:
            cache[("text", start)] = tokenizer.decode(greedy_continuation(full, prompt, new_tokens))
        texts_f.append(cache[("text", start)])
        texts_q.append(tokenizer.decode(greedy_continuation(quant, prompt, new_tokens)))
    scored = score_outputs("quant-heldout", texts_q, texts_f, references=truths)
    return QualityResult(kl_sum / count, math.exp(nll_f / count), math.exp(nll_q / count), agree / count,
                         scored.chrf_ref_full, scored.chrf_ref_optimised, scored.chrf_agreement, scored.retention,
                         count, len(truths))


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
    grid = [[parse_scheme(resolved[f"layers.{i}.{k}"]).bits_per_weight(
        shape[f"layers.{i}.{k}"].out_features, shape[f"layers.{i}.{k}"].in_features) for k in GROUP_KINDS]
        for i in layers]
    fig, ax = plt.subplots(figsize=(5.5, 0.28 * len(layers) + 1.6))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=4, vmax=16 if any(
        resolved[g.name] == "none" for g in groups) else 8.1)
    for r, i in enumerate(layers):
        for c, k in enumerate(GROUP_KINDS):
            label = resolved[f"layers.{i}.{k}"].replace("int4sym-", "s").replace("int4-", "")
            ax.text(c, r, label, ha="center", va="center", fontsize=6, color="white" if grid[r][c] < 6 else "black")
    ax.set_xticks(range(len(GROUP_KINDS)), GROUP_KINDS)
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=6)
    ax.set_ylabel("layer")
    ax.set_title(f"{title}\nlm_head: {resolved['lm_head']}", fontsize=8)
    fig.colorbar(im, ax=ax, label="bits per weight (incl. scales)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out_dir: str | Path, resolved: dict[str, str], groups: list[WeightGroup],
                 quality: QualityResult, model_name: str, full_weight_bytes: int) -> Path:
    """Write report.md, report.json and bits.png into ``out_dir``; returns the markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    numel = sum(g.numel for g in groups)
    size = plan_nbytes(resolved, groups)
    summary = {"model": model_name, "bits_per_weight": round(8 * size / numel, 4),
               "quantised_groups_mb": round(size / 1e6, 3), "full_groups_mb_bf16": round(full_weight_bytes / 1e6, 3),
               **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(quality).items()},
               "plan": resolved}
    (out / "report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    bits_heatmap(resolved, groups, out / "bits.png", f"{model_name}: {summary['bits_per_weight']} bits/weight")
    md = [f"# Quantisation report: {model_name}", "",
          f"- average bits per weight (scales and zeros included): **{summary['bits_per_weight']}**",
          f"- quantised groups: {summary['quantised_groups_mb']} MB (the same groups in bf16: "
          f"{summary['full_groups_mb_bf16']} MB)",
          f"- held-out text: {quality.tokens} tokens; mean KL(full || quantised) = {quality.mean_kl:.5f} nats/token",
          f"- perplexity: full {quality.perplexity_full:.3f}, quantised {quality.perplexity_quant:.3f}",
          f"- next-token agreement with the full model: {100 * quality.next_token_agreement:.2f} %",
          f"- chrF of greedy continuations vs the true text ({quality.prompts} prompts): "
          f"full {quality.chrf_full:.2f}, quantised {quality.chrf_quant:.2f}; chrF agreement between the "
          f"two models' continuations {quality.chrf_agreement:.2f}",
          f"- quality retention (chrF ratio, capped at 1): **{100 * quality.quality_retention:.1f} %**", "",
          "![bits per group](bits.png)", "", bits_table(resolved, groups), ""]
    (out / "report.md").write_text("\n".join(md), encoding="utf-8")
    return out / "report.md"
