#!/usr/bin/env python3
"""Build the reply store of the ``retrieval`` draft (edge_rtgi.llm.retrieval) for the default model.

1. **Replies.** The engine, as the daemon runs it (catalogue GGUF, ``quant: auto``), answers the
   project's own prompt corpus (scripts/draft_corpus.py, apart from the benchmark's workloads)
   greedily: the same stage, and the same cache in ``--work-dir``, as scripts/train_draft.py.
2. **Check.** A store of 95 % of the replies drafts for the other 5 %: at every position of a
   held-out reply, the draft proposes up to k = 4 tokens; the script prints the share of
   positions with a proposal, the acceptance of proposed tokens and the mean accepted length.
3. **Store.** All replies, with the tokenizer's fingerprint and the conditions in the header.

    .venv/bin/python scripts/build_reply_store.py [--out edge_rtgi/llm/data/...]

Then put the file's sha256 and size in models/catalog.yaml.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_draft import generate_replies  # noqa: E402

from edge_rtgi.catalog import resolve_model  # noqa: E402
from edge_rtgi.llm.request import Request  # noqa: E402
from edge_rtgi.llm.retrieval import ReplyStore, RetrievalDraft, save_reply_store  # noqa: E402
from edge_rtgi.llm.sampling import SamplingParams  # noqa: E402
from edge_rtgi.llm.tokenizer import tokenizer_fingerprint  # noqa: E402
from edge_rtgi.llm.weights import load_model  # noqa: E402

DEFAULT_OUT = ROOT / "edge_rtgi" / "llm" / "data" / "smollm2-135m-instruct-replies.safetensors"


def held_out_check(rows: list[dict], seed: int, k: int = 4) -> dict[str, float]:
    """Draft for 5 % of the replies from a store of the rest: the share of positions with a
    proposal, acceptance of proposed tokens, and accepted tokens per position."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_held = max(8, len(rows) // 20)
    held = [rows[i] for i in order[:n_held]]
    draft = RetrievalDraft(ReplyStore.of([rows[i]["reply"] for i in order[n_held:]]))
    positions = proposing = proposed = accepted = 0
    for row in held:
        reply = row["reply"]
        for i in range(1, len(reply)):
            request = Request(f"held-{i}", row["prompt"] + reply[:i], SamplingParams())
            guess = draft.propose(request, k)
            run = 0
            while run < len(guess) and i + run < len(reply) and guess[run] == reply[i + run]:
                run += 1
            positions += 1
            proposing += bool(guess)
            proposed += len(guess)
            accepted += run
    return {
        "held_out_replies": len(held),
        "positions": positions,
        "proposing": round(proposing / max(positions, 1), 3),
        "acceptance": round(accepted / max(proposed, 1), 3),
        "accepted_per_position": round(accepted / max(positions, 1), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/edge-rtgi-draft"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = generate_replies(args.model, args.work_dir, args.seed)
    check = held_out_check(rows, args.seed)
    print(f"held out (k = 4): {check}", flush=True)
    tokenizer = load_model(resolve_model(args.model, role="llm"), device="cpu").tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer to fingerprint")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "target": args.model,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "built": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "script": "scripts/build_reply_store.py",
        "corpus": {
            "prompts": len(rows),
            "reply_tokens": sum(len(r["reply"]) for r in rows),
            "forms": dict(Counter(r["form"] for r in rows)),
        },
        "held_out_check": check,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    save_reply_store(args.out, [r["reply"] for r in rows], meta)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"wrote {args.out}: {args.out.stat().st_size} bytes, sha256 {digest}")


if __name__ == "__main__":
    main()
