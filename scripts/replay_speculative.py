#!/usr/bin/env python3
"""Replay speculative decoding over the target's own greedy replies, with no timing at all.

Two things bound the batch-1 speed-up: how many drafted tokens hold, and what a step carrying n
tokens costs against a plain step. A timed benchmark (scripts/bench_speculative.py) sees both
through the machine's noise. This script takes them apart:

1. The engine, as the daemon runs it, answers ``--prompts`` prompts per workload greedily at
   batch 1, ``--max-tokens`` each (cached in ``--work-dir``).
2. Each setting's drafts and policy (the engine's own ``Speculator``, with the catalogue's reply
   store) are replayed over those replies: at every step the setting proposes, the reply says
   how many drafted tokens hold, and the step is charged its cost from a given table of step
   costs (``--costs``: a step of 1, 2, ... tokens relative to a plain one; the policy reads the
   same table). A setting's speed-up is tokens per unit of cost; greedy verification keeps the
   reply as it is, so this is exact for the given costs.
3. Also a ceiling for the drafts' own proposals: ``oracle`` verifies exactly the tokens of the
   own-text-then-store proposal (up to 8) that will hold, so it never pays for a rejected one.

    .venv/bin/python scripts/replay_speculative.py --costs 1,1.18,1.31,1.33,1.51,1.53,1.64,1.75,1.84
    # several tables, separated by ';' (what cheaper verification would be worth); each gives the
    # cost of 1 to 9 tokens, as the policy may draft up to 8:
    .venv/bin/python scripts/replay_speculative.py \
        --costs '1,1.18,1.31,1.33,1.51,1.53,1.64,1.75,1.84;1,1.1,1.2,1.3,1.4,1.5,1.6,1.7,1.8'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_speculative import WORKLOADS, prompts_for  # noqa: E402

from edge_rtgi.bench.suite import stepped_engine  # noqa: E402
from edge_rtgi.llm.engine import LLMEngine, load_retrieval_draft  # noqa: E402
from edge_rtgi.llm.request import Request, RequestClass  # noqa: E402
from edge_rtgi.llm.retrieval import RetrievalDraft  # noqa: E402
from edge_rtgi.llm.sampling import SamplingParams  # noqa: E402
from edge_rtgi.llm.speculative import (  # noqa: E402
    K_CHOICES,
    Draft,
    NgramDraft,
    SpeculativeConfig,
    Speculator,
    StepSize,
)

ORACLE_MAX_TOKENS = 8
TABLE_SIZES = 1 + max(K_CHOICES)  # a table prices every step the policy may choose


@dataclass
class Reply:
    """One prompt of a workload and the target's greedy reply to it; ``cut`` when the reply
    stopped at the token limit (the engine then drafts no further than the limit)."""

    prompt: list[int]
    reply: list[int]
    request_class: RequestClass
    cut: bool = False


@dataclass
class Replayed:
    """Tokens a setting produced over a workload's replies, the cost it paid (in plain steps),
    and its verification steps and accepted drafts."""

    tokens: int = 0
    cost: float = 0.0
    verify_steps: int = 0
    accepted: int = 0

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0


def greedy_replies(engine: LLMEngine, prompts: int, max_tokens: int, work: Path) -> dict[str, list[Reply]]:
    """The engine's greedy replies at batch 1 per workload, cached in ``work`` per model."""
    path = work / f"replay-replies-{engine.config.model.replace('/', '_')}-{prompts}x{max_tokens}.json"
    if path.exists():
        raw = json.loads(path.read_text())
    else:
        raw = {}
        for w in (*WORKLOADS, "adversarial"):
            raw[w] = []
            for ids, cls in prompts_for(engine, w, prompts):
                out = engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
                raw[w].append({"prompt": ids, "reply": list(out.token_ids), "class": cls.value})
            print(f"replies: {w} {len(raw[w])}", flush=True)
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(raw))
    return {
        w: [
            Reply(r["prompt"], r["reply"], RequestClass(r["class"]), cut=len(r["reply"]) >= max_tokens)
            for r in rows
        ]
        for w, rows in raw.items()
    }


def held(proposal: list[int], reply: list[int], at: int) -> int:
    """How many of ``proposal`` match ``reply`` from position ``at`` on."""
    n = 0
    while n < len(proposal) and at + n < len(reply) and proposal[n] == reply[at + n]:
        n += 1
    return n


def replay(replies: list[Reply], make: Callable[[], Speculator], costs: list[float], prefix: str) -> Replayed:
    """``make()``'s speculator over ``replies``: each step proposes, keeps what the reply holds,
    and pays ``costs[n - 1]`` for a step of n tokens."""
    spec = make()
    for n, ratio in enumerate(costs, start=1):  # the table the policy reads: as measured, fixed
        spec.costs.observe(n, ratio)
    out = Replayed()
    for j, item in enumerate(replies):
        request = Request(
            f"{prefix}-{j}", list(item.prompt), SamplingParams(), request_class=item.request_class
        )
        request.append_output_token(item.reply[0])
        at = 1
        while at < len(item.reply):
            spec.propose([(request, None)])
            # as the scheduler caps drafts: never past the table, nor past the token limit
            room = len(item.reply) - at - 1 if item.cut else len(costs) - 1
            draft = list(request.draft_token_ids or [])[: min(len(costs) - 1, room)]
            got = held(draft, item.reply, at)
            new = item.reply[at : at + got + 1]
            spec.observe(
                {request.request_id: request},
                {request.request_id: len(draft)} if draft else {},
                {request.request_id: got} if draft else {},
                {request.request_id: new},
                StepSize(1, 1 + len(draft)),
                costs[len(draft)],
            )
            out.cost += costs[len(draft)]
            out.tokens += len(new)
            if draft:
                out.verify_steps += 1
                out.accepted += got
            for token in new:
                request.append_output_token(token)
            request.draft_token_ids = []
            at += len(new)
        spec.release(request)
    return out


def oracle(replies: list[Reply], draft: Draft, costs: list[float], prefix: str) -> Replayed:
    """Verify only the proposed tokens that will hold: the most these proposals can give."""
    out = Replayed()
    for j, item in enumerate(replies):
        request = Request(f"{prefix}-{j}", list(item.prompt), SamplingParams())
        request.append_output_token(item.reply[0])
        at = 1
        while at < len(item.reply):
            room = len(item.reply) - at - 1 if item.cut else ORACLE_MAX_TOKENS
            got = held(draft.propose(request, min(ORACLE_MAX_TOKENS, len(costs) - 1, room)), item.reply, at)
            new = item.reply[at : at + got + 1]
            out.cost += costs[got]
            out.tokens += len(new)
            out.verify_steps += bool(got)
            out.accepted += got
            for token in new:
                request.append_output_token(token)
            at += len(new)
        draft.release(request.request_id)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=30, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--costs",
        required=True,
        help="step cost relative to a plain step for 1, 2, ... tokens, comma-separated (the first is 1); "
        "several tables separated by ';'",
    )
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/edge-rtgi-draft"))
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    tables = [[float(c) for c in t.split(",")] for t in args.costs.split(";") if t.strip()]
    for t in tables:
        if len(t) < TABLE_SIZES or t[0] != 1.0 or any(b < a for a, b in zip(t, t[1:], strict=False)):
            ap.error(f"--costs: each table prices 1..{TABLE_SIZES} tokens, from 1, never falling; got {t}")
    engine = stepped_engine(2)  # the engine's default kernels, which speculation runs on too
    replies = greedy_replies(engine, args.prompts, args.max_tokens, args.work_dir)

    loaded = load_retrieval_draft(None, engine.model, engine.tokenizer, engine.config.model)
    assert isinstance(loaded, RetrievalDraft), "the catalogue's reply store did not load"

    def store(own: NgramDraft) -> RetrievalDraft:
        """The catalogue's reply store (indexed once) behind ``own`` text first, as the engine builds it."""
        return RetrievalDraft(loaded.store, loaded.min_confidence, own)

    def auto() -> Speculator:
        own = NgramDraft()
        return Speculator(SpeculativeConfig("auto"), [own, store(own)])

    def fixed(name: str, k: int) -> Callable[[], Speculator]:
        def make() -> Speculator:
            draft: Draft = store(NgramDraft()) if name == "retrieval" else NgramDraft()
            return Speculator(SpeculativeConfig("fixed", name, k), [draft])

        return make

    settings: dict[str, Callable[[], Speculator]] = {
        "auto": auto,
        "auto-ngram": lambda: Speculator(SpeculativeConfig("auto"), [NgramDraft()]),
    }
    for name in ("ngram", "retrieval"):
        for k in (2, 3, 4):
            settings[f"{name}:{k}"] = fixed(name, k)
    tables_out: list[dict[str, object]] = []
    report = {"prompts": args.prompts, "max_tokens": args.max_tokens, "tables": tables_out}
    for costs in tables:
        print(f"\nstep costs by tokens carried: {', '.join(f'{c:g}' for c in costs)}")
        print(f"{'setting':<13}" + "".join(f"{w:>26}" for w in replies))
        rows: dict[str, dict[str, dict[str, float]]] = {}
        results = {
            name: {w: replay(r, make, costs, f"{name}-{w}") for w, r in replies.items()}
            for name, make in settings.items()
        }
        results["oracle"] = {
            w: oracle(r, store(NgramDraft()), costs, f"oracle-{w}") for w, r in replies.items()
        }
        for name, per in results.items():
            cells = []
            for w, got in per.items():
                length = got.accepted / got.verify_steps if got.verify_steps else 0.0
                cells.append(f"{got.speedup:5.2f}x L{length:4.2f} v{got.verify_steps:4d}")
                rows.setdefault(name, {})[w] = {
                    "speedup": got.speedup,
                    "tokens": got.tokens,
                    "verify_steps": got.verify_steps,
                    "accepted": got.accepted,
                }
            print(f"{name:<13}" + "".join(f"{c:>26}" for c in cells))
        tables_out.append({"costs": costs, "settings": rows})
    print(
        "\nspeed-up = tokens per unit of step cost (a plain step = 1); L = accepted drafts per verification"
    )
    print("step; v = verification steps")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
