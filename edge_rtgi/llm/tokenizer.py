"""Tokenizers for HF folders and GGUF files, and chat templates rendered the way HF renders them.

A ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust fast tokenizer) plus what lives
beside it: special token ids, whether a BOS token is added, and the chat template. Chat
prompts are rendered with a sandboxed Jinja environment that offers the helpers HF chat
templates rely on (``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape
HTML), and then encoded *without* adding special tokens, exactly as transformers'
``apply_chat_template(tokenize=True)`` does: the template writes any BOS it wants itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from edge_rtgi.errors import ModelFileError, RequestError

log = logging.getLogger(__name__)

# llama.cpp's GGUF token types (llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# Pre-tokenizer split rules for the byte-level vocabularies llama.cpp names in `tokenizer.ggml.pre`
# (see llama-vocab.cpp). Anything unnamed here gets GPT-2's rule.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# SmolLM's vocabulary was trained with every digit on its own (llama.cpp's "smollm" pre-type).
_DIGIT_PRES = {"smollm", "starcoder", "refact"}

# Gemma's chat template (as google/gemma-3-*-it ships it, for text content), for GGUF files of
# base models that carry none: a system message is folded into the first user turn, the
# assistant's role is "model", and a turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_END_OF_TURN = "<end_of_turn>"


class ChatTokenizer(Protocol):
    """What the engine and the benchmark need of a tokenizer (``Tokenizer`` is the one we ship)."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...


@dataclass
class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    backend: BackendTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"pad_token": "<pad>"}

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` adds BOS/EOS as the model's post-processor says."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``. Bytes of an unfinished UTF-8 character come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template."""
        if not self.chat_template:
            raise RequestError(
                "this model has no chat template",
                hint="use `edge-rtgi generate` with a raw prompt, or pick an instruct model",
            )
        import jinja2

        context = {**self.special_tokens, "bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return _compile_template(self.chat_template).render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template rejected the conversation: {exc}") from None

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat prompt (special tokens come from the template itself)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of a tokenizer's token strings in id order: two tokenizers with the same
    fingerprint map every id to the same token."""
    backend = tokenizer.backend
    h = hashlib.sha256()
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        h.update((backend.id_to_token(i) or "").encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt text.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFileError(f"the model's chat template does not parse: {exc}") from None


# --- HF folders --------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"cannot read {path}: {exc}", hint="re-download the model") from None


def _hf_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    # transformers 5 writes chat_template.jinja; older saves put it in tokenizer_config.json.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def load_hf_tokenizer(folder: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """Tokenizer from an HF folder (``tokenizer.json`` + ``tokenizer_config.json``)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(
            f"{folder} has no tokenizer.json", hint="only fast (tokenizer.json) tokenizers are supported"
        )
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception for any parse error
        raise ModelFileError(f"cannot parse {path}: {exc}", hint="re-download the model") from None
    config_path = folder / "tokenizer_config.json"
    tok_config = _read_json(config_path) if config_path.is_file() else {}
    contents = {k: _token_content(v) for k, v in tok_config.items() if k.endswith("_token")}
    special = {k: v for k, v in contents.items() if v is not None}
    bos, eos = special.get("bos_token"), special.get("eos_token")
    eos_ids = list(eos_token_ids)
    eos_id = backend.token_to_id(eos) if eos is not None else None
    if eos_id is not None:
        eos_ids.append(eos_id)
    return Tokenizer(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        chat_template=_hf_chat_template(folder, tok_config),
        special_tokens=special,
    )


# --- GGUF metadata -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        log.warning("GGUF pre-tokenizer %r is not known; using GPT-2's split rule", pre)
    return byte_level


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str]) -> tuple[BackendTokenizer, set[str]]:
    """Byte-level BPE (GPT-2 style): tokens are spelled in GPT-2's printable byte alphabet."""
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # a control token spelled in raw text, e.g. with a space
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend, alphabet


def _sentencepiece_merges(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    # A SentencePiece BPE vocabulary has no merge list; a token's score is its merge rank.
    # Every split of a token into two known pieces is a merge, ordered by the token's score.
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores, strict=False):
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        candidates += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str]) -> tuple[BackendTokenizer, None]:
    """SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1 files)."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_sentencepiece_merges(tokens, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    return backend, None


def _plain_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer's metadata with arrays as lists (``gguf_file`` leaves them lazy or numpy)."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            if hasattr(value, "tolist"):
                value = value.tolist()
            elif not isinstance(value, (str, bytes, list, int, float, bool)) and value is not None:
                value = list(value)  # a lazy string array
            out[key] = value
    return out


def load_gguf_tokenizer(meta: Mapping[str, Any], source: Path) -> Tokenizer:
    """Build the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

    Supports byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen2) and
    SentencePiece BPE with byte fallback (``"llama"``: Llama 2, Mistral v0.1).
    """
    meta = _plain_metadata(meta)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama") or not tokens:
        raise ModelFileError(
            f"{source}: GGUF tokenizer type {kind!r} is not supported (only 'gpt2' byte-level BPE and "
            "'llama' SentencePiece BPE)",
            hint="use the model's HF folder (tokenizer.json) instead",
        )
    backend, alphabet = (_byte_level_backend if kind == "gpt2" else _sentencepiece_backend)(meta, tokens)

    # Control tokens (<|im_start|>, <s>) are matched whole and skipped when decoding; user-defined
    # ones (<think>) are matched whole but kept. A byte-level "control" token spelled outside the
    # byte alphabet is a llama.cpp mislabel and is left alone, as transformers does.
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelled = (lambda t: set(t) <= alphabet) if alphabet else (lambda t: True)
    control = [t for t, k in zip(tokens, types, strict=False) if k == _GGUF_CONTROL and spelled(t)]
    user = [t for t, k in zip(tokens, types, strict=False) if k == _GGUF_USER_DEFINED and spelled(t)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token_at(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    elif kind == "gpt2":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Chat models often end a turn with a token other than EOS (Llama 3's <|eot_id|>).
    eos_ids = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    template = meta.get("tokenizer.chat_template")
    if meta.get("general.architecture") == "gemma3":
        # Gemma files name no end-of-turn token; its chat format ends turns with <end_of_turn>.
        eos_ids.append(backend.token_to_id(GEMMA_END_OF_TURN))
        template = template or GEMMA_CHAT_TEMPLATE
    special = {
        name: t
        for name, t in (
            ("bos_token", bos),
            ("eos_token", eos),
            ("unk_token", token_at("unknown_token_id")),
            ("pad_token", token_at("padding_token_id")),
        )
        if t is not None
    }
    return Tokenizer(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if isinstance(i, int))),
        chat_template=template,
        special_tokens=special,
    )
