"""Does the LLM engine's resident size grow with the prompt shapes it has seen? (issue #18)

Runs batches of 1-4 prompts of random length (or, with ``--fixed-shape``, always 2 prompts of
150 words) through one ``LLMEngine`` and prints the process's RSS every ``--every`` batches
(docs/reliability.md, "RSS: what grows"). ``--trim-every`` calls ``malloc_trim`` that often, to
tell freed-but-kept memory from memory still held.

    flock /tmp/bench.lock .venv/bin/python scripts/llm_memory_growth.py --batches 300
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_rtgi.llm.engine import LLMEngine
from edge_rtgi.llm.engine_config import EngineConfig
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.server.memory import trim_heap

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired engineers measure memory growth "
    "in long running speech daemons today"
).split()


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=EngineConfig().model)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--every", type=int, default=30, help="print RSS every so many batches")
    ap.add_argument("--fixed-shape", action="store_true", help="2 prompts of 150 words, 6 new tokens")
    ap.add_argument("--trim-every", type=int, default=0, help="malloc_trim every so many batches")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = LLMEngine.from_config(EngineConfig(model=args.model))
    rng = random.Random(args.seed)
    engine.generate("Hello", SamplingParams(max_tokens=4))
    print(f"after warm-up: {rss_mb():.0f} MB", flush=True)
    t0 = time.monotonic()
    for i in range(1, args.batches + 1):
        n = 2 if args.fixed_shape else rng.randint(1, 4)
        words = [150 if args.fixed_shape else rng.randint(3, 300) for _ in range(n)]
        prompts = [" ".join(rng.choice(WORDS) for _ in range(w)) for w in words]
        new_tokens = 6 if args.fixed_shape else rng.randint(1, 12)
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
        if args.trim_every and i % args.trim_every == 0:
            trim_heap()
        if i % args.every == 0:
            print(f"batch {i}: {rss_mb():.0f} MB ({time.monotonic() - t0:.0f} s)", flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
