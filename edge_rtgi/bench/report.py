"""Markdown + PNG + JSON reports from a benchmark result dict (``runner.run_suite``'s output).

``write_report(results, folder)`` writes ``report.md``, ``results.json`` and the figures
(latency CDFs, throughput against offered load, ablation bars, peers). The markdown is built
from the JSON alone, so ``edge-rtgi bench report results.json --report DIR`` re-renders it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from edge_rtgi.bench.targets_check import evaluate_targets


def _f(value: Any, digits: int = 0, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}{unit}"


def _pct(value: Any) -> str:
    return (
        "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.0f} %"
    )


def _dist(d: dict, digits: int = 0) -> str:
    return f"{_f(d['p50'], digits)} / {_f(d['p95'], digits)} / {_f(d['p99'], digits)}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


# --- Figures ----------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(results: dict, path: Path) -> bool:
    workloads = results.get("workloads") or []
    if not workloads:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for w in workloads:
        for ax, key in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
            values = sorted(v for v in w["samples"][key] if not math.isnan(v))
            if values:
                ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                ax.step([values[0], *values], ys, where="post", label=w["name"])
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "inter-token latency"), strict=True):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{title} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if key == "ttft_ms" else "fraction of tokens")
        ax.grid(alpha=0.3)
        slos = {w["slo"]["ttft_ms" if key == "ttft_ms" else "itl_ms"] for w in workloads}
        for s in slos:
            ax.axvline(s, color="grey", linestyle="--", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency CDFs at each workload's offered load (dashed: SLOs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_ramp(results: dict, path: Path) -> bool:
    ramp = results.get("ramp")
    if not ramp or not ramp["stages"]:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=80)
    rates = [s["rate_rps"] for s in ramp["stages"]]
    ax.plot(
        rates, [s["metrics"]["throughput_tok_s"] for s in ramp["stages"]], "o-", label="throughput (tok/s)"
    )
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, 1.2 * max(s["metrics"]["throughput_tok_s"] or 0.0 for s in ramp["stages"]) + 1e-9)
    ax2 = ax.twinx()
    ax2.plot(
        rates,
        [100 * s["metrics"]["slo_attainment"] for s in ramp["stages"]],
        "s--",
        color="tab:red",
        label="SLO attainment (%)",
    )
    ax2.set_ylabel("requests meeting SLO (%)")
    ax2.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    fig.legend(loc="lower right", fontsize=8, bbox_to_anchor=(0.85, 0.2))
    ax.set_title(f"Throughput against offered load ({ramp['workload']} workload)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_ablations(results: dict, path: Path) -> bool:
    abl = results.get("ablations") or {}
    rows = [r for r in abl.get("rows", []) if "metrics" in r]
    if not rows:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.8), dpi=80)
    labels = [r["label"] for r in rows]
    panels = (
        ("TTFT p95 (ms, log)", lambda r: r["metrics"]["ttft_ms"]["p95"]),
        ("throughput (tok/s)", lambda r: r["metrics"]["throughput_tok_s"]),
        ("SLO attainment (%)", lambda r: 100 * (r["metrics"]["slo_attainment"] or 0.0)),
        ("quality retention", lambda r: (r.get("quality") or {}).get("retention")),
    )
    for ax, (title, get) in zip(axes, panels, strict=True):
        values = [get(r) for r in rows]
        ax.bar(range(len(rows)), [v if v is not None else 0.0 for v in values], color="tab:blue")
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=35, ha="right")
        if title.startswith("TTFT"):
            ax.set_yscale("log")
        elif title.startswith("SLO"):
            ax.set_ylim(0, 100)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Ablations on the {abl['workload']} workload (one switch changed per bar)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _short_label(entry: dict) -> str:
    if entry["kind"] == "ours-variant":
        return f"engine {entry.get('variant', '')}"
    return entry["name"].split(" (")[0].replace("edge-rtgi ", "").replace("HF transformers", "HF")


def plot_peers(results: dict, path: Path) -> bool:
    peers = results.get("peers")
    if not peers or not peers["entries"]:
        return False
    plt = _plt()
    entries = peers["entries"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6), dpi=80)
    labels = [_short_label(e) for e in entries]
    panels = (
        ("batch-1 decode (tok/s)", lambda e: e["batch1"]["decode_tok_s"]),
        ("batch-1 TTFT (ms)", lambda e: e["batch1"]["ttft_ms"]),
        ("throughput under load (tok/s)", lambda e: e["load"]["throughput_tok_s"]),
    )
    colors = ["tab:green" if e["kind"].startswith("ours") else "tab:grey" for e in entries]
    for ax, (title, get) in zip(axes, panels, strict=True):
        ax.barh(range(len(entries)), [get(e) for e in entries], color=colors)
        ax.set_yticks(range(len(entries)), labels if ax is axes[0] else [""] * len(entries), fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Same model, same prompts, same thread count", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


FIGURES = (
    ("latency_cdf.png", plot_latency_cdfs),
    ("throughput_vs_load.png", plot_ramp),
    ("ablations.png", plot_ablations),
    ("peers.png", plot_peers),
)


# --- Markdown ---------------------------------------------------------------------------------


def _model_line(results: dict, opt: dict) -> str:
    model = results.get("model")
    if not model:
        return f"- Model: whatever the daemon at {results.get('daemon', {}).get('url')} serves."
    return (
        f"- Model: {model['name']} (`{Path(model['source']).name}`); engine dtype {model['engine_dtype']}; "
        f"quantisation: {opt['quant'] or 'none (not enabled in this run)'}."
    )


def _conditions(results: dict) -> list[str]:
    m, cfg = results["machine"], results["config"]
    opt = cfg["optimisations"]
    git = m.get("git") or {}
    load = m.get("load_average")
    lines = [
        "## Conditions",
        "",
        f"- Date (UTC): {m['date_utc']}; commit `{(git.get('commit') or 'unknown')[:10]}`"
        f"{' (with uncommitted changes)' if git.get('dirty') else ''}; "
        f"whole run {_f(results.get('elapsed_s'), 0)} s.",
        f"- Machine: {m['cpu']}, {m['cpu_count']} cores, {_f(m.get('memory_gib'), 0)} GiB"
        f"{', GPU ' + m['cuda_device'] if m.get('cuda_device') else ', no GPU'}; "
        f"{cfg['num_threads']} threads for every engine.",
        f"- Load average at start / end: {', '.join(f'{x:.1f}' for x in load) if load else '–'} / "
        f"{', '.join(f'{x:.1f}' for x in m.get('load_average_end') or []) or '–'} "
        "(other processes shared the cores; absolute numbers are noisy, same-run ratios less so).",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ".",
        "- Environment: "
        + (", ".join(f"`{k}={v}`" for k, v in (m.get("env") or {}).items()) or "nothing set")
        + ".",
        _model_line(results, opt),
    ]
    if results.get("daemon"):
        return [
            *lines,
            "- Decoding and prompts: as the daemon's pipeline sets them; one seeded run per workload.",
            "",
        ]
    lines += [
        f"- Engine switches: prefix caching {'on' if opt['prefix_caching'] else 'off'}, max_num_seqs "
        f"{opt['max_num_seqs']}, chunked prefill {'on' if opt['chunked_prefill'] else 'off'} "
        f"({opt['max_num_batched_tokens']} tokens per step), kv dtype {opt['kv_dtype']}.",
        "- Decoding: greedy everywhere. Each load run is one seeded run; latency percentiles are over its "
        "requests (tokens for ITL). Batch-1 figures are medians of "
        f"{cfg['decode_runs']} runs after a warm-up.",
        # results saved before the field existed started cold
        "- Each load run starts "
        + (
            "with its requests' shared prompt prefix in the prefix cache, as a serving daemon has it."
            if cfg.get("warm_start", False) and opt["prefix_caching"]
            else "from an empty prefix cache."
        ),
        "",
    ]
    return lines


def _targets(results: dict) -> list[str]:
    if not (results.get("workloads") or results.get("peers")):
        return []
    rows = [[t["target"], t["measured"], t["status"]] for t in evaluate_targets(results)]
    return [
        "## Where the engine stands against the targets",
        "",
        *_table(["target", "measured (this run)", "status"], rows),
    ]


def _workloads(results: dict) -> list[str]:
    ws = results.get("workloads") or []
    if not ws:
        return []
    rows = []
    for w in ws:
        m, load = w["metrics"], w["load"]
        offered = f"{load['pattern']} {load['rate_rps']:g}/s" + (
            f" (bursts of {load['burst_size']})" if load["pattern"] == "burst" else ""
        )
        rows.append(
            [
                w["name"],
                f"{w['slo']['ttft_ms']:g} / {w['slo']['itl_ms']:g}",
                offered,
                f"{m['num_ok']}/{m['num_requests']}",
                _dist(m["ttft_ms"]),
                _dist(m["itl_ms"], 1),
                _dist(m["e2e_ms"]),
                _f(m["throughput_tok_s"], 1),
                _f(m["goodput_rps"], 2),
                _f(m["peak_rss_mb"], 0),
                f"{m['kv_blocks_peak']}/{m['kv_blocks_total']}",
            ]
        )
    header = [
        "workload",
        "SLO TTFT/ITL (ms)",
        "offered load",
        "ok/sent",
        "TTFT p50/p95/p99 (ms)",
        "ITL p50/p95/p99 (ms)",
        "E2E p50/p95/p99 (ms)",
        "throughput (tok/s)",
        "goodput (req/s)",
        "peak RSS (MiB)",
        "KV blocks peak/total",
    ]
    out = ["## Workloads on the engine", "", *_table(header, rows)]
    errors = [(w["name"], e) for w in ws for e in w.get("errors", [])]
    out += [f"- {name}: {e}" for name, e in errors] + ([""] if errors else [])
    out += ["![latency CDFs](IMG/latency_cdf.png)", ""]
    return out


def _rtiq(results: dict) -> list[str]:
    ws = results.get("workloads") or []
    if not ws:
        return []
    rows = []
    for w in ws:
        q, r, kl = w["quality"], w["rtiq"], w["quality"].get("kl")
        task = q["task"]
        iv = task["interval"]
        kl_txt = (
            f"{_f(kl['mean'], 4)} / {_f(kl['p99'], 3)} / {_pct(kl['top1_agreement'])}"
            if kl
            else "0 (same weights)"
        )
        rows.append(
            [
                w["name"],
                f"**{_f(r['value'], 2)}**",
                f"{_f(r['quality_retention'], 3)} [{_f(iv['low'], 3)}, {_f(iv['high'], 3)}]",
                _pct(r["slo_attainment"]),
                _pct(r["ttft_attainment"]),
                _pct(r["itl_attainment"]),
                f"{task['metric']}: {_f(iv['optimised_score'], 3)} / {_f(iv['full_score'], 3)}",
                str(iv["n"]),
                _f(q["fidelity_chrf"], 1),
                kl_txt,
            ]
        )
    header = [
        "workload",
        "RTIQ",
        "task retention [95 % CI]",
        "meet TTFT+ITL",
        "meet TTFT",
        "meet ITL",
        "task score opt / full",
        "graded items",
        "fidelity (chrF vs full)",
        "KL mean / p99 / top-1 agree",
    ]
    return [
        "## RTIQ per workload, with its parts",
        "",
        *_table(header, rows),
        "Task retention = min(1, task score of the engine / task score of the full model, fp32 on the "
        "plain path) on the same graded items, with a paired bootstrap interval over items "
        "(docs/benchmarks.md). Fidelity and KL are diagnostics and do not enter it. "
        + "; ".join(f"{w['name']}: {w['quality']['basis']}" for w in ws)
        + ".",
        "",
    ]


def _ramp(results: dict) -> list[str]:
    ramp = results.get("ramp")
    if not ramp:
        return []
    rows = [
        [
            f"{s['rate_rps']:g}",
            f"{s['metrics']['num_ok']}/{s['metrics']['num_requests']}",
            _dist(s["metrics"]["ttft_ms"]),
            _f(s["metrics"]["itl_ms"]["p95"], 1),
            _f(s["metrics"]["throughput_tok_s"], 1),
            _f(s["metrics"]["goodput_rps"], 2),
            _pct(s["metrics"]["slo_attainment"]),
        ]
        for s in ramp["stages"]
    ]
    sat = (
        f"saturates at {ramp['saturation_rps']:g} req/s"
        if ramp["saturation_rps"] is not None
        else "did not saturate within the ramp"
    )
    sus = f"{ramp['sustained_rps']:g} req/s" if ramp["sustained_rps"] is not None else "none of the stages"
    note = [f"Note: {ramp['note']}", ""] if ramp.get("note") else []
    return [
        f"## Ramp to saturation ({ramp['workload']} workload)",
        "",
        *note,
        *_table(
            [
                "offered (req/s)",
                "ok/sent",
                "TTFT p50/p95/p99 (ms)",
                "ITL p95 (ms)",
                "throughput (tok/s)",
                "goodput (req/s)",
                "meet SLO",
            ],
            rows,
        ),
        f"Highest rate with at least {100 * ramp['threshold']:.0f} % of requests meeting the SLO: "
        f"{sus}; {sat}.",
        "",
        "![throughput against offered load](IMG/throughput_vs_load.png)",
        "",
    ]


def _ablations(results: dict) -> list[str]:
    abl = results.get("ablations")
    if not abl:
        return []
    rows = []
    for r in abl["rows"]:
        if "metrics" not in r:
            rows.append([r["label"], "skipped: " + r["skipped"]] + [""] * 9)
            continue
        m, q = r["metrics"], r.get("quality") or {}
        kl = (q.get("kl") or {}).get("mean")
        rows.append(
            [
                r["label"],
                _dist(m["ttft_ms"]),
                _f(m["itl_ms"]["p95"], 1),
                _f(m["throughput_tok_s"], 1),
                _f(m["goodput_rps"], 2),
                _pct(m["slo_attainment"]),
                _f(q.get("retention"), 3),
                "0" if kl is None and q else _f(kl, 4),
                _f((r.get("rtiq") or {}).get("value"), 2),
                _pct(r["prefix_hit_rate"]),
                _f(r["requests_per_step"], 2),
            ]
        )
    load = abl["load"]
    return [
        f"## Ablations ({abl['workload']} workload, {load['pattern']} {load['rate_rps']:g} req/s, "
        f"{load['num_requests']} requests)",
        "",
        *_table(
            [
                "switch changed",
                "TTFT p50/p95/p99 (ms)",
                "ITL p95 (ms)",
                "throughput (tok/s)",
                "goodput (req/s)",
                "meet SLO",
                "task retention",
                "KL mean",
                "RTIQ",
                "prefix-cache hits",
                "requests per step",
            ],
            rows,
        ),
        "![ablations](IMG/ablations.png)",
        "",
    ]


def _mixed(results: dict) -> list[str]:
    mixed = results.get("mixed")
    if not mixed:
        return []
    policies = mixed["summary"]["policies"]
    ratios = mixed["summary"]["slo_over_fcfs"]
    rows = []
    for policy, table in policies.items():
        for key, row in table["scales"].items():
            per_class = "; ".join(
                f"{name} {_pct(c['attainment'])} ({_f(c['ttft_p95_ms'])} / {_f(c['itl_p95_ms'], 1)})"
                for name, c in row["classes"].items()
            )
            r = ratios.get(key, {}) if policy == "slo" else {}
            ratio, low, high = r.get("attainment"), r.get("attainment_low"), r.get("attainment_high")
            interval = ""
            if low is not None:  # results saved before the interval existed have none
                interval = f" [{_f(low, 2)}, {_f(high, 2) if high is not None else 'unbounded'}]"
            rows.append(
                [
                    policy,
                    f"x{row['rate_scale']:g} ({row['offered_rps']:.2g} req/s)",
                    _pct(row["attainment"]),
                    _f(ratio, 2) + interval if ratio is not None else "",
                    _f(row["goodput_rps"], 2),
                    per_class,
                ]
            )
    sustained = ", ".join(
        f"{p} x{t['highest_sustained_scale']:g}" if t["highest_sustained_scale"] is not None else f"{p} none"
        for p, t in policies.items()
    )
    header = [
        "scheduling",
        "rate scale",
        "meet SLO",
        "slo / fcfs [95 % interval]",
        "goodput (req/s)",
        "per workload: meet SLO",
    ]
    models = [_step_model_line(p, m) for p, m in mixed.get("step_model", {}).items()]
    return [
        "## Mixed load: every workload at once",
        "",
        f"{mixed['rounds']} run(s) of {mixed['duration_s']:g} s of arrivals per policy and scale, policies "
        "alternating; per workload: attainment (p95 TTFT ms / p95 ITL ms, medians over runs). The "
        "ratio's interval is a paired bootstrap over rounds (each round's arrivals are the same for "
        "both policies). Highest "
        f"scale with at least 90 % meeting the SLO: {sustained}.",
        "",
        *_table(header, rows),
        "Step-time model at the end (fitted online; error measured before each step): " + "; ".join(models),
        "",
    ]


def _step_model_line(policy: str, m: dict) -> str:
    c = m["coefficients_ms"]
    return (
        f"{policy}: {_f(c[0], 1)} ms + {_f(c[1], 2)} ms/decode row + {_f(c[2], 3)} ms/prefill token + "
        f"{_f(c[3], 2)} ms/1k context tokens"
        + (f" + {_f(c[4], 1)} ms on the Python layers" if len(c) > 4 else "")
        + f", error {_f(m['error_ms'], 1)} ms ({_f(m['error_pct'], 0)} %) "
        + (f"(p97 overshoot {_f(m['overshoot_ms'], 1)} ms) " if "overshoot_ms" in m else "")
        + f"over {m['num_observations']} steps"
    )


def _peers(results: dict) -> list[str]:
    peers = results.get("peers")
    if not peers:
        return []
    rows = [
        [
            e["name"],
            _f(e["batch1"]["decode_tok_s"], 1),
            _f(e["batch1"]["ttft_ms"], 0),
            f"{e['batch1']['reference_prefix_match']}/{e['batch1']['tokens']}",
            _f(e["load"]["throughput_tok_s"], 1),
            _f(e["load"]["ttft_ms"]["p95"], 0),
            _f(e["load"]["e2e_ms"]["p95"], 0),
        ]
        for e in peers["entries"]
    ]
    out = [
        f"## Peers side by side (batch 1: {peers['decode_prompt_tokens']}-token prompt, "
        f"{peers['decode_new_tokens']} new tokens; "
        f"under load: {peers['load_requests']} voice prompts at once, "
        f"{peers['load_max_tokens']} tokens each)",
        "",
        *_table(
            [
                "engine",
                "decode (tok/s, median)",
                "TTFT (ms, median)",
                "greedy tokens equal to fp32 ref",
                "throughput under load (tok/s)",
                "TTFT p95 under load (ms)",
                "E2E p95 under load (ms)",
            ],
            rows,
        ),
    ]
    if peers["ratios"]:
        rrows = [
            [
                r.get("ours", "edge-rtgi engine").replace("edge-rtgi engine ", ""),
                r["vs"],
                _f(r["decode_speed"], 2, "x"),
                _f(r["ttft"], 2, "x"),
                _f(r["throughput_under_load"], 2, "x"),
            ]
            for r in peers["ratios"]
        ]
        out += [
            "Ratios ours / theirs (decode and throughput: higher is better; TTFT: lower is better):",
            "",
            *_table(["our engine", "vs", "batch-1 decode", "TTFT", "throughput under load"], rrows),
        ]
    out += [f"- Skipped {s['name']}: {s['reason']}" for s in peers["skipped"]]
    return [*out, "", "![peers](IMG/peers.png)", ""]


def _daemon(results: dict) -> list[str]:
    daemon = results.get("daemon")
    if not daemon:
        return []
    rows = [
        [
            w["name"],
            f"{w['slo']['ttft_ms']:g} / {w['slo']['itl_ms']:g}",
            f"{w['load']['rate_rps']:g}/s",
            f"{w['metrics']['num_ok']}/{w['metrics']['num_requests']}",
            _dist(w["metrics"]["ttft_ms"]),
            _dist(w["metrics"]["itl_ms"], 1),
            _f(w["metrics"]["goodput_rps"], 2),
            _pct(w["metrics"]["slo_attainment"]),
            _f(w.get("chrf_vs_references"), 1),
        ]
        for w in daemon["workloads"]
    ]
    return [
        f"## Workloads over WebSocket ({daemon['url']})",
        "",
        "Latency as a client sees it (ITL per text delta); the daemon builds its own prompts, so quality "
        "retention and RTIQ are not measured here.",
        "",
        *_table(
            [
                "workload",
                "SLO TTFT/ITL (ms)",
                "offered",
                "ok/sent",
                "TTFT p50/p95/p99 (ms)",
                "ITL p50/p95/p99 (ms)",
                "goodput (req/s)",
                "meet SLO",
                "chrF vs refs",
            ],
            rows,
        ),
        *[
            f"- {w['name']}: sent {e['sent']!r}, received {e['received']!r}"
            for w in daemon["workloads"]
            for e in w.get("examples", [])[:1]
        ],
        "",
    ]


def render_markdown(results: dict, image_prefix: str = "") -> str:
    """The report as markdown; figure links are ``image_prefix + name``."""
    lines = ["# edge-rtgi benchmark report", ""]
    for part in (_conditions, _targets, _workloads, _rtiq, _ramp, _ablations, _mixed, _peers, _daemon):
        lines += part(results)
    return "\n".join(lines).replace("IMG/", image_prefix)


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf as None and tuples as lists, so results.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def write_report(results: dict, folder: str | Path, image_prefix: str = "") -> Path:
    """Write report.md, results.json and the PNG figures into ``folder``; returns report.md's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    results = json_safe(results)
    (folder / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False))
    made = {name for name, plot in FIGURES if plot(results, folder / name)}
    text = render_markdown(results, image_prefix)
    for name, _ in FIGURES:  # drop links to figures that had no data
        if name not in made:
            text = "\n".join(line for line in text.splitlines() if f"{image_prefix}{name}" not in line)
    path = folder / "report.md"
    path.write_text(text + "\n")
    return path


RESULTS_HEADING = "## Results on this machine"


def embed_in_doc(results: dict, doc: str | Path, image_prefix: str, how: str) -> None:
    """Replace everything from ``RESULTS_HEADING`` to the end of ``doc`` with this report.

    Headings are demoted one level so the report nests under that heading; ``how`` (the command
    that produced the run) is written first.
    """
    doc = Path(doc)
    text = doc.read_text()
    if RESULTS_HEADING not in text:
        from edge_rtgi.errors import ConfigError

        raise ConfigError(f"{doc} has no {RESULTS_HEADING!r} heading to put the results under")
    body = render_markdown(json_safe(results), image_prefix).split("\n", 2)[2]  # drop the report's title
    body = "\n".join("#" + line if line.startswith("## ") else line for line in body.splitlines())
    head = text.split(RESULTS_HEADING)[0]
    doc.write_text(f"{head}{RESULTS_HEADING}\n\nProduced by `{how}`.\n\n{body.strip()}\n")


def run_conditions(
    started_monotonic_s: float, load_at_start: tuple[float, float, float], **settings: object
) -> dict:
    """The conditions a benchmark script records beside its figures: when, at which commit, the
    load average at its start and end, how long it ran, and its own ``settings``."""
    import subprocess
    import time

    root = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": commit.stdout.strip(),
        "load_average": [load_at_start, os.getloadavg()],
        "seconds": round(time.monotonic() - started_monotonic_s, 1),
        **settings,
    }
