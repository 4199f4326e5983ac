"""``edge-rtgi generate`` and ``edge-rtgi chat``: talk to a language model from the terminal.

Both commands get tokens from a ``Backend``: one object with a tokenizer, a context size and
``stream(prompt_ids, params)``. ``open_backend`` builds it: the LLM engine by default, or with
``--plain`` the plain generation path over a contiguous KV cache (the engine's reference).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_rtgi.errors import EdgeRtgiError, RequestError
from edge_rtgi.llm.sampling import SamplingParams

if TYPE_CHECKING:
    from edge_rtgi.llm.tokenizer import Tokenizer

FALLBACK_MODEL = "smollm2-135m-instruct"


@dataclass
class Backend:
    """Where tokens come from: ``stream(prompt_ids, params)`` yields GenerationDelta-like objects."""

    tokenizer: Tokenizer
    context_tokens: int
    stream: Callable[[Sequence[int], SamplingParams], Iterator]


def open_backend(
    model: str, device: str, dtype: str, plain: bool = False, quant: str | None = "auto"
) -> Backend:
    """Load ``model`` (catalogue name or path) and return the generation backend for the CLI.

    Default: the LLM engine (paged KV, prefix cache). ``plain``: the reference path. Both run
    on the same weights: ``quant`` ("auto", "none", a scheme, plan or checkpoint) is applied
    before either is built.
    """
    from edge_rtgi.llm.generate import generate_stream
    from edge_rtgi.llm.prepared import load_prepared

    # A prepared copy of the weights (llm.prepared) makes the second start fast.
    loaded = load_prepared(model, device=device, dtype=dtype, quant=quant).loaded
    if plain:
        return Backend(
            tokenizer=loaded.tokenizer,
            context_tokens=loaded.config.max_position_embeddings,
            stream=lambda ids, params: generate_stream(loaded, ids, params),
        )
    from edge_rtgi.llm.engine import LLMEngine

    engine = LLMEngine.from_loaded(loaded)

    def stream(ids: Sequence[int], params: SamplingParams) -> Iterator:
        for delta in engine.stream(list(ids), params):
            if delta.error:
                raise RequestError(delta.error)
            yield delta

    context_tokens = engine.max_model_len
    if not isinstance(context_tokens, int):  # the engine derives it from the model's int config
        raise TypeError(f"engine.max_model_len is a {type(context_tokens).__name__}, not an int")
    return Backend(tokenizer=loaded.tokenizer, context_tokens=context_tokens, stream=stream)


def default_model_name() -> str:
    try:
        from edge_rtgi.catalog import default_model

        return default_model("llm")
    except (ImportError, EdgeRtgiError):
        return FALLBACK_MODEL


def _add_common(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="catalogue name or path to an HF folder / .gguf file (default: the catalogue's default LLM)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, fp32, bf16, fp16")
    parser.add_argument(
        "--quant",
        default="auto",
        help="weights: auto (bf16 CPU: Q4_1 blocks as int4-g32, the rest int8), none, int8, int4-g64, "
        "a plan YAML or a checkpoint",
    )
    parser.add_argument("--plain", action="store_true", help="use plain generation instead of the engine")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from CLI flags (raises RequestError for bad values before any model loads)."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def register(subparsers) -> None:
    gen = subparsers.add_parser(
        "generate", help="continue a raw prompt with a language model (streams to stdout)"
    )
    _add_common(gen, max_tokens=128)
    gen.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    gen.set_defaults(func=cmd_generate)

    chat = subparsers.add_parser("chat", help="interactive chat with the model's chat template")
    _add_common(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt (kept when old turns are dropped)")
    chat.set_defaults(func=cmd_chat)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise RequestError("the prompt is empty", hint="pass the prompt text as an argument, or - for stdin")
    backend = open_backend(
        args.model or default_model_name(), args.device, args.dtype, args.plain, args.quant
    )
    # A raw prompt gets the model's own special tokens (e.g. BOS for Llama), as HF's generate does.
    prompt_ids = backend.tokenizer.encode(prompt, add_special_tokens=True)
    for delta in backend.stream(prompt_ids, params):
        _write(delta.text)
    _write("\n")
    return 0


# --- chat ----------------------------------------------------------------------------------


def fit_history(
    tokenizer, system: str | None, history: list[dict[str, str]], context_tokens: int, reserve_tokens: int
) -> tuple[list[int], int]:
    """Prompt ids for system + history, dropping the oldest turns until ``reserve_tokens`` fit.

    ``history`` ends with the new user message and alternates user/assistant. Returns the
    ids and how many leading history messages were dropped. Raises RequestError when even
    the newest message alone does not fit.
    """
    head = [{"role": "system", "content": system}] if system else []
    dropped = 0
    while True:
        ids = tokenizer.encode_chat(head + history[dropped:], add_generation_prompt=True)
        if len(ids) + reserve_tokens <= context_tokens:
            return ids, dropped
        if dropped >= len(history) - 1:
            raise RequestError(
                f"the message is {len(ids)} tokens with the chat template, and with "
                f"{reserve_tokens} tokens reserved for the reply the context window of "
                f"{context_tokens} tokens is exceeded",
                hint="send a shorter message",
            )
        dropped += 2  # a whole user+assistant turn; history alternates and ends with the user


def chat_turn(
    backend: Backend,
    system: str | None,
    history: list[dict[str, str]],
    params: SamplingParams,
    write: Callable[[str], None] = _write,
) -> str:
    """Run one reply for ``history`` (ending with the user's message), stream it, return it."""
    reserve = min(params.max_tokens, backend.context_tokens // 2)
    ids, dropped = fit_history(backend.tokenizer, system, history, backend.context_tokens, reserve)
    del history[:dropped]
    parts = []
    for delta in backend.stream(ids, params):
        parts.append(delta.text)
        write(delta.text)
    write("\n")
    return "".join(parts)


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    backend = open_backend(
        args.model or default_model_name(), args.device, args.dtype, args.plain, args.quant
    )
    if not getattr(backend.tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template", hint="use `edge-rtgi generate` instead")
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            "Type a message; Ctrl-C stops a reply, /reset clears the conversation, /quit or Ctrl-D ends.",
            file=sys.stderr,
        )
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        message = line.strip()
        if not message:
            continue
        if message in ("/quit", "/exit"):
            return 0
        if message == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": message})
        try:
            reply = chat_turn(backend, args.system, history, params)
        except RequestError as exc:  # one bad turn does not end the session
            history.pop()
            print(f"edge-rtgi: error: {exc}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the session
            history.pop()
            print("\n(reply interrupted)", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
