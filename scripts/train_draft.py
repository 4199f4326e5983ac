#!/usr/bin/env python3
"""Train the EAGLE draft (edge_rtgi.llm.eagle) for the default model on this machine.

1. **Replies.** The engine, as the daemon runs it (catalogue GGUF, ``quant: auto``), answers the
   project's own prompt corpus (scripts/draft_corpus.py: chats with and without the daemon's
   system prompt, voice commands, translation requests, Python prefixes) greedily.
2. **Features.** The target (the same file, fp32, plain path) runs over each prompt + reply and
   keeps its final hidden state at every position: what its LM head reads.
3. **Head.** The draft scores only the ``--head-tokens`` most frequent tokens of the replies
   (EOS included); the script prints how much of the replies they cover.
4. **Training.** The draft reads (embedding of x_{i+1}, f_i) and is trained to give f_{i+1}
   (smooth L1) and, through the target's head, x_{i+2} (cross-entropy, weight ``--cls-weight``),
   on reply positions only; prompt positions are its context. Features get Gaussian noise
   (``--noise``), so that the draft learns to read its own imperfect guesses. AdamW, cosine
   schedule, sequences packed into ``--pack-tokens`` rows with a block-diagonal causal mask.
5. **Held-out check.** 5 % of the replies: teacher-forced top-1 accuracy, and the mean accepted
   length when drafting k = 4 tokens greedily from every reply position, as the engine does.

Writes the draft (int8 per output row, safetensors, training conditions in its header).
Stages 1-2 are cached in ``--work-dir``, so a second run trains without regenerating.

    .venv/bin/python scripts/train_draft.py [--minutes 40] [--out edge_rtgi/llm/data/drafts/...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from draft_corpus import CorpusPrompt, corpus  # noqa: E402

from edge_rtgi.bench.workloads import system_prompt  # noqa: E402
from edge_rtgi.catalog import resolve_model  # noqa: E402
from edge_rtgi.llm.eagle import (  # noqa: E402
    DraftKVCache,
    EagleDraftModel,
    EagleDraftSpec,
    SequenceBackend,
    save_draft,
)
from edge_rtgi.llm.engine import LLMEngine  # noqa: E402
from edge_rtgi.llm.engine_config import EngineConfig  # noqa: E402
from edge_rtgi.llm.model import ContiguousKVCache, Transformer  # noqa: E402
from edge_rtgi.llm.prepared import load_prepared  # noqa: E402
from edge_rtgi.llm.sampling import SamplingParams  # noqa: E402
from edge_rtgi.llm.tokenizer import tokenizer_fingerprint  # noqa: E402
from edge_rtgi.llm.weights import load_model  # noqa: E402

DEFAULT_OUT = ROOT / "edge_rtgi" / "llm" / "data" / "smollm2-135m-instruct-eagle.safetensors"


def _key(p: CorpusPrompt) -> str:
    return json.dumps([p.messages, p.text, p.max_tokens])


def generate_replies(model_name: str, work: Path, seed: int) -> list[dict]:
    """The engine's greedy reply to every corpus prompt (cached in ``work`` by prompt)."""
    path = work / "replies.json"
    cached = {r["key"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    prompts = corpus(system_prompt(), seed)
    missing = [p for p in prompts if _key(p) not in cached]
    if missing:
        # the replies of the engine's default kernels, which speculation runs on too
        engine = LLMEngine.from_config(EngineConfig(model=model_name))
        tok = engine.tokenizer
        assert tok is not None
        ids = [
            tok.encode_chat([{"role": r, "content": c} for r, c in p.messages], add_generation_prompt=True)
            if p.messages
            else tok.encode(p.text)
            for p in missing
        ]
        t0 = time.perf_counter()
        params = [SamplingParams(max_tokens=p.max_tokens, temperature=0.0) for p in missing]
        results = engine.generate(ids, params)
        took = time.perf_counter() - t0
        engine.shutdown()
        for p, i, r in zip(missing, ids, results, strict=True):
            cached[_key(p)] = {"key": _key(p), "form": p.form, "prompt": i, "reply": list(r.token_ids)}
        n = sum(len(r.token_ids) for r in results)
        print(f"replies: {len(missing)} new prompts, {n} reply tokens in {took:.0f} s ({n / took:.0f} tok/s)")
        path.write_text(json.dumps(list(cached.values())))
    return [cached[_key(p)] for p in prompts]


def target_features(target: Transformer, rows: list[dict], path: Path) -> list[torch.Tensor]:
    """The target's final hidden states over each prompt + reply (cached in ``path`` by sequence)."""
    stored: dict[str, torch.Tensor] = torch.load(path) if path.exists() else {}
    if isinstance(stored, list):  # an earlier cache, in the order of its rows
        stored = {}
    missing = [r for r in rows if r["key"] not in stored]
    t0 = time.perf_counter()
    with torch.inference_mode():
        for r in missing:
            seq = r["prompt"] + r["reply"]
            cache = ContiguousKVCache(target.config, len(seq), target.dtype, target.device)
            cache.begin(len(seq))
            hidden = target(torch.tensor(seq), torch.arange(len(seq)), cache)
            cache.commit()
            stored[r["key"]] = hidden.to(torch.bfloat16)
    if missing:
        took = time.perf_counter() - t0
        print(
            f"features: {sum(len(stored[r['key']]) for r in missing)} positions in {took:.0f} s", flush=True
        )
        torch.save(stored, path)
    return [stored[r["key"]] for r in rows]


def pick_head(rows: list[dict], count: int, eos: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    counts = Counter(t for r in rows for t in r["reply"])
    ids = [t for t, _ in counts.most_common(count)]
    for e in eos:
        if e not in ids:
            ids[-1 - eos.index(e)] = e
    covered = sum(counts[t] for t in ids) / max(1, sum(counts.values()))
    return torch.tensor(sorted(set(ids)), dtype=torch.long), covered


class Example:
    """One sequence ready for training: inputs for rows i = 0..T-2 and their targets. Rows more
    than a window before the reply are dropped: no reply row can attend to them."""

    def __init__(self, row: dict, feats: torch.Tensor, head_index: dict[int, int], window: int):
        seq = row["prompt"] + row["reply"]
        prompt_len = len(row["prompt"])
        first = max(0, prompt_len - 2 - window)
        self.positions = torch.arange(first, len(seq) - 1)
        self.length = len(self.positions)
        self.next_ids = torch.tensor(seq[first + 1 :])  # x_{i+1}
        self.features = feats[first:-1]  # f_i
        self.target_features = feats[first + 1 :]  # f_{i+1}
        after = seq[first + 2 :] + [-1]  # x_{i+2}
        self.target_ids = torch.tensor([head_index.get(t, -100) if t >= 0 else -100 for t in after])
        self.loss_rows = self.positions >= prompt_len - 2  # x_{i+2} is a reply token
        self.loss_rows[-1] = False


def packs(examples: list[Example], pack_tokens: int, rng: random.Random) -> list[list[Example]]:
    order = examples[:]
    rng.shuffle(order)
    out: list[list[Example]] = [[]]
    size = 0
    for ex in order:
        if size + ex.length > pack_tokens and out[-1]:
            out.append([])
            size = 0
        out[-1].append(ex)
        size += ex.length
    return out


def train(
    draft: EagleDraftModel,
    embed: torch.nn.Embedding,
    head: torch.Tensor,
    train_set: list[Example],
    args: argparse.Namespace,
) -> dict:
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    # steps are planned from the first epoch's pace so the cosine schedule ends at the deadline
    first_epoch = packs(train_set, args.pack_tokens, rng)
    step, planned, epoch, history = 0, None, 0, []
    t_start = time.monotonic()
    batches = first_epoch
    while True:
        for batch in batches:
            if planned is not None and step >= planned:
                break
            if time.monotonic() > deadline and planned is None:
                planned = step
                break
            dev = head.device
            pos = torch.cat([ex.positions for ex in batch]).to(dev)
            seg = torch.cat([torch.full((ex.length,), i) for i, ex in enumerate(batch)]).to(dev)
            ids = torch.cat([ex.next_ids for ex in batch]).to(dev)
            f_in = torch.cat([ex.features for ex in batch]).to(dev).float()
            f_out = torch.cat([ex.target_features for ex in batch]).to(dev).float()
            y = torch.cat([ex.target_ids for ex in batch]).to(dev)
            rows = torch.cat([ex.loss_rows for ex in batch]).to(dev)
            if args.noise:
                f_in = f_in + torch.randn_like(f_in) * args.noise
            with torch.no_grad():
                e = embed(ids)
            lr_scale = min(1.0, (step + 1) / args.warmup_steps)
            if planned is not None:
                lr_scale *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / planned)))
            for g in opt.param_groups:
                g["lr"] = args.lr * max(lr_scale, 0.02)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
                h = draft(e, f_in, pos, SequenceBackend(pos, draft.spec.window_tokens, seg))
                h = h.float()[rows]
                reg = F.smooth_l1_loss(h, f_out[rows])
                logits = h @ head.T
                cls = F.cross_entropy(logits, y[rows], ignore_index=-100)
            loss = reg + args.cls_weight * cls
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 25 == 0:
                with torch.no_grad():
                    mask = y[rows] >= 0
                    acc = (logits.argmax(-1)[mask] == y[rows][mask]).float().mean().item()
                history.append(
                    {
                        "step": step,
                        "reg": round(reg.item(), 4),
                        "cls": round(cls.item(), 3),
                        "acc": round(acc, 3),
                    }
                )
                print(
                    f"step {step} epoch {epoch} reg {reg.item():.4f} cls {cls.item():.3f} acc {acc:.3f} "
                    f"({(time.monotonic() - t_start) / 60:.1f} min)",
                    flush=True,
                )
        else:
            epoch += 1
            if planned is None:
                elapsed = time.monotonic() - t_start
                per_step = elapsed / max(1, step)
                planned = step + int((deadline - time.monotonic()) / per_step)
                print(f"planned {planned} steps ({per_step:.2f} s per step)", flush=True)
            batches = packs(train_set, args.pack_tokens, rng)
            continue
        if planned is not None and step >= planned:
            break
        batches = packs(train_set, args.pack_tokens, rng)
        epoch += 1
    return {"steps": step, "epochs": round(step / max(1, len(first_epoch)), 2), "history": history[-8:]}


@torch.inference_mode()
def evaluate(
    draft: EagleDraftModel, embed: torch.nn.Embedding, head: torch.Tensor, held: list[Example], k: int
) -> dict:
    """Teacher-forced top-1 accuracy and, drafting k tokens from every reply position with the
    draft's own guesses fed back (as at run time), the mean number accepted."""
    draft = draft.float().eval()
    ids_of_head = draft.head_token_ids
    correct = total = 0
    accepted: list[int] = []
    cfg = draft.spec.model_config()
    for ex in held:
        pos = ex.positions
        h = draft(
            embed(ex.next_ids), ex.features.float(), pos, SequenceBackend(pos, draft.spec.window_tokens)
        )
        rows = ex.loss_rows & (ex.target_ids >= 0)
        pred = (h @ head.T).argmax(-1)
        correct += int((pred[rows] == ex.target_ids[rows]).sum())
        total += int(rows.sum())
        # drafting at every reply position, as at run time: true entries for positions up to n
        # (row n's output guesses f_{n+1}, so x_{n+2}), then the draft's own guesses fed back
        truth = ex.next_ids.tolist()  # truth[i] = x_{i+1}
        cache = DraftKVCache(cfg, torch.float32, torch.device("cpu"))
        first = int(ex.loss_rows.nonzero()[0]) if ex.loss_rows.any() else ex.length - 1
        if first > 0:
            draft(embed(ex.next_ids[:first]), ex.features[:first].float(), torch.arange(first), cache)
        for n in range(first, ex.length - 1):
            cur = draft(
                embed(ex.next_ids[n : n + 1]), ex.features[n : n + 1].float(), torch.tensor([n]), cache
            )
            got = 0
            for j in range(k):
                if n + 1 + j >= len(truth):
                    break
                token = int(ids_of_head[int((cur @ head.T).argmax(-1))])
                if token != truth[n + 1 + j]:
                    break
                got += 1
                if j < k - 1:
                    cur = draft(embed(torch.tensor([token])), cur, torch.tensor([n + 1 + j]), cache)
            cache.truncate(n + 1)
            accepted.append(got)
    return {
        "teacher_forced_top1": round(correct / max(1, total), 4),
        f"mean_accepted_k{k}": round(statistics.fmean(accepted), 3) if accepted else 0.0,
        "positions": len(accepted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/edge-rtgi-draft"))
    ap.add_argument(
        "--minutes", type=float, default=40.0, help="training time (the cosine schedule ends there)"
    )
    ap.add_argument("--head-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128, help="draft attention window (tokens)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--pack-tokens", type=int, default=2048)
    ap.add_argument("--cls-weight", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.1, help="std of Gaussian noise on input features")
    ap.add_argument(
        "--bf16", action="store_true", help="train under bf16 autocast (faster where the CPU has AMX)"
    )
    ap.add_argument(
        "--device", default=None, help="where to train: cpu or cuda (default: cuda where there is one)"
    )
    ap.add_argument(
        "--features",
        choices=("served", "fp32"),
        default="served",
        help="features of the model as the engine serves it (quant auto, bf16 here) or of the fp32 model",
    )
    ap.add_argument("--init-from-last-layer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-after", choices=("replies", "features"), default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    rows = generate_replies(args.model, args.work_dir, args.seed)
    if args.stop_after == "replies":
        return
    loaded = load_model(resolve_model(args.model, role="llm"), device="cpu", dtype=torch.float32)
    target = loaded.model.eval()
    if args.features == "served":  # what the draft reads at run time: the engine's own numerics
        served = load_prepared(
            resolve_model(args.model, role="llm"), "cpu", "auto", "auto"
        ).loaded.model.eval()
        feats = target_features(served, rows, args.work_dir / "features-served.pt")
        del served
    else:
        feats = target_features(target, rows, args.work_dir / "features.pt")
    if args.stop_after == "features":
        return
    for p in target.parameters():
        p.requires_grad_(False)

    head_ids, covered = pick_head(rows, args.head_tokens, tuple(target.config.eos_token_ids))
    print(f"head: {len(head_ids)} tokens cover {covered:.1%} of reply tokens", flush=True)
    head_index = {int(t): i for i, t in enumerate(head_ids)}
    head = target.lm_head.weight.detach()[head_ids].float()
    embed = target.embed_tokens

    spec = EagleDraftSpec.for_target(
        target.config, args.model, tokenizer_fingerprint(loaded.tokenizer), args.window, len(head_ids)
    )
    draft = EagleDraftModel(spec)
    draft.head_token_ids.copy_(head_ids)
    if args.init_from_last_layer:  # start from the target's own last layer: it already maps features
        draft.layer.load_state_dict(target.layers[-1].state_dict())
    with torch.no_grad():  # fc starts as "take the feature": the layer then refines f_i into f_{i+1}
        draft.fc.weight.zero_()
        draft.fc.weight[:, spec.hidden_size :].copy_(torch.eye(spec.hidden_size))
        draft.fc.weight[:, : spec.hidden_size].normal_(0, 0.01)

    examples = [
        Example(r, f, head_index, args.window)
        for r, f in zip(rows, feats, strict=True)
        if len(r["reply"]) >= 2
    ]
    rng = random.Random(args.seed)
    rng.shuffle(examples)
    n_held = max(8, len(examples) // 20)
    held, train_set = examples[:n_held], examples[n_held:]
    reply_tokens = sum(len(r["reply"]) for r in rows)
    print(f"examples: {len(train_set)} train, {len(held)} held out; {reply_tokens} reply tokens", flush=True)

    before = evaluate(draft, embed, head, held[:24], k=4)
    print(f"before training: {before}", flush=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    if device.type != "cpu":  # train there; features and the evaluation stay on the CPU
        target.to(device)
        draft.to(device)
        log = train(draft, target.embed_tokens, head.to(device), train_set, args)
        draft.to("cpu")
        target.to("cpu")
    else:
        log = train(draft, embed, head, train_set, args)
    train_s = time.perf_counter() - t0
    after = evaluate(draft, embed, head, held, k=4)
    print(f"after training ({train_s / 60:.1f} min): {after}", flush=True)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "trained": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "script": "scripts/train_draft.py",
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("out", "work_dir")},
        "corpus": {
            "prompts": len(rows),
            "reply_tokens": reply_tokens,
            "forms": dict(Counter(r["form"] for r in rows)),
        },
        "head_coverage": round(covered, 4),
        "train_minutes": round(train_s / 60, 1),
        "total_minutes": round((time.perf_counter() - t_all) / 60, 1),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "cpu": os.uname().machine,
        "held_out": after,
        "training": log,
    }
    save_draft(args.out, draft, meta)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)", flush=True)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
