"""Graded task sets with gold answers: the quality yardstick beside the speed workloads.

Four sets, one per workload, in ``bench/data/tasks/<name>.jsonl`` (one JSON object per line, so
that an error can name its line); formats, scoring rules and calibration are in
docs/task-sets.md:

- ``voice``: short spoken-style questions with accepted answers; accuracy by normalised
  containment of an accepted answer in the reply.
- ``dialogue``: multi-turn chats whose last user turn asks for a fact the user gave 1, 4, 12 or
  30 exchanges earlier; scored like voice.
- ``code``: Python prefixes with their true next line; exact match and edit similarity of the
  first generated non-empty line.
- ``translation``: English sentences with Spanish references; corpus chrF, with BLEU beside it.

Prompts are built as ``bench/workloads.py`` builds them (same system prompts, same output budget
rule for translation), so a task item reaches the engine exactly as a workload item would.
A retention figure (optimised / full, capped at 1) comes with a paired bootstrap interval over
items: ``paired_ratio_interval`` for per-item scores, ``paired_chrf_ratio_interval`` for chrF.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_rtgi.bench.workloads import (
    TRANSLATION_SYSTEM,
    VOICE_SUFFIX,
    ChatTokenizer,
    PreparedRequest,
    get_workload,
    system_prompt,
    translation_budget_tokens,
)
from edge_rtgi.errors import ConfigError

TASK_SET_NAMES = ("voice", "dialogue", "code", "translation")
DIALOGUE_DISTANCES = (1, 4, 12, 30)  # exchanges between the fact and the question
TASKS_DIR = Path(__file__).resolve().parent / "data" / "tasks"

# Output budgets of the graded runs (translation: the workload's own rule, see ``max_new_tokens``).
VOICE_MAX_TOKENS = 48
DIALOGUE_MAX_TOKENS = 48
CODE_MAX_TOKENS = 32


# --- Records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One chat turn of a dialogue item: ``role`` is "user" or "assistant"."""

    role: str
    content: str


@dataclass(frozen=True)
class VoiceItem:
    """A spoken-style question (lower case, no punctuation) and its accepted answers."""

    id: str
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class DialogueItem:
    """A conversation ending in a user question about a fact given ``distance_turns`` exchanges back."""

    id: str
    distance_turns: int
    messages: tuple[Message, ...]
    answers: tuple[str, ...]


@dataclass(frozen=True)
class CodeItem:
    """A Python prefix (ending at the end of a line) and the true next non-empty line, indented."""

    id: str
    prefix: str
    next_line: str


@dataclass(frozen=True)
class TranslationItem:
    """An English sentence and one or more Spanish reference translations."""

    id: str
    source: str
    references: tuple[str, ...]


TaskItem = VoiceItem | DialogueItem | CodeItem | TranslationItem


@dataclass(frozen=True)
class TaskSet:
    """A loaded task set: its name, its items in file order and the file they came from."""

    name: str
    items: tuple[TaskItem, ...]
    path: Path

    def __len__(self) -> int:
        return len(self.items)


# --- Loading ----------------------------------------------------------------------------------

_FIELDS: dict[str, dict[str, str]] = {  # set -> field -> kind
    "voice": {"id": "str", "question": "str", "answers": "str_list"},
    "dialogue": {"id": "str", "distance_turns": "int", "messages": "messages", "answers": "str_list"},
    "code": {"id": "str", "prefix": "str", "next_line": "str"},
    "translation": {"id": "str", "source": "str", "references": "str_list"},
}


class _LineError(Exception):
    """A reason why one line of a task file is refused (turned into a ConfigError with the line)."""


def task_set_path(name: str) -> Path:
    """The shipped file of task set ``name``; ConfigError naming the choices for an unknown name."""
    if name not in TASK_SET_NAMES:
        raise ConfigError(f"unknown task set {name!r}", hint=f"choose from {', '.join(TASK_SET_NAMES)}")
    return TASKS_DIR / f"{name}.jsonl"


def load_task_set(name: str, path: Path | None = None) -> TaskSet:
    """Load and check task set ``name`` from ``path`` (default: the shipped file).

    Loading is strict: a line that is not a JSON object, a missing or unknown field, a field of
    the wrong type, an empty string or answers/references list, a malformed dialogue or a
    duplicate id is refused with a ConfigError naming the file, the line and the reason.
    Blank lines are skipped; a file with no items is refused.
    """
    file = Path(path) if path is not None else task_set_path(name)
    if name not in _FIELDS:
        raise ConfigError(f"unknown task set {name!r}", hint=f"choose from {', '.join(TASK_SET_NAMES)}")
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"task file {file} does not exist", hint=f"give the path of a {name} .jsonl file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"task file {file} cannot be read: {exc}") from None
    items: list[TaskItem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = _parse_line(name, line)
            if item.id in seen:
                raise _LineError(f"duplicate id {item.id!r} (first on line {seen[item.id]})")
        except _LineError as exc:
            raise ConfigError(
                f"{file}, line {lineno}: {exc}",
                hint=f"each line of a {name} task file is one JSON object; see docs/task-sets.md",
            ) from None
        seen[item.id] = lineno
        items.append(item)
    if not items:
        raise ConfigError(f"task file {file} has no items", hint="write one JSON object per line")
    return TaskSet(name=name, items=tuple(items), path=file)


def _parse_line(name: str, line: str) -> TaskItem:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _LineError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise _LineError(f"expected a JSON object, got {type(record).__name__}")
    fields = _FIELDS[name]
    missing = [f for f in fields if f not in record]
    if missing:
        raise _LineError(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    unknown = sorted(set(record) - set(fields))
    if unknown:
        raise _LineError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(a {name} item has {', '.join(fields)})"
        )
    values = {f: _check_field(f, kind, record[f]) for f, kind in fields.items()}
    if name == "voice":
        return VoiceItem(**values)
    if name == "dialogue":
        dialogue = DialogueItem(**values)
        _check_dialogue(dialogue)
        return dialogue
    if name == "code":
        code = CodeItem(**values)
        _check_code(code)
        return code
    return TranslationItem(**values)


def _check_field(field: str, kind: str, value: Any) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise _LineError(f"{field} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise _LineError(f"{field} is empty")
        return value
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise _LineError(f"{field} must be an integer, got {type(value).__name__}")
        return value
    if kind == "str_list":
        if not isinstance(value, list):
            raise _LineError(f"{field} must be a list of strings, got {type(value).__name__}")
        if not value:
            raise _LineError(f"{field} is an empty list (give at least one)")
        for k, entry in enumerate(value):
            if not isinstance(entry, str) or not entry.strip():
                raise _LineError(f"{field}[{k}] must be a non-empty string, got {entry!r}")
        return tuple(value)
    # messages
    if not isinstance(value, list) or not value:
        raise _LineError(f"{field} must be a non-empty list of messages")
    messages = []
    for k, entry in enumerate(value):
        if not isinstance(entry, dict) or set(entry) != {"role", "content"}:
            raise _LineError(f"{field}[{k}] must be an object with exactly role and content")
        role, content = entry["role"], entry["content"]
        if role not in ("user", "assistant"):
            raise _LineError(f"{field}[{k}].role must be user or assistant, got {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise _LineError(f"{field}[{k}].content must be a non-empty string")
        messages.append(Message(role, content))
    return tuple(messages)


def _check_dialogue(item: DialogueItem) -> None:
    for k, message in enumerate(item.messages):
        expected = "user" if k % 2 == 0 else "assistant"
        if message.role != expected:
            raise _LineError(
                f"messages[{k}] is {message.role!r} but turns must alternate user, assistant, "
                f"starting with user"
            )
    if item.messages[-1].role != "user":
        raise _LineError("the last message must be the user's question")
    exchanges = (len(item.messages) - 1) // 2
    if item.distance_turns < 1 or item.distance_turns > exchanges:
        raise _LineError(
            f"distance_turns {item.distance_turns} must be between 1 and the number of "
            f"exchanges before the question ({exchanges})"
        )


def _check_code(item: CodeItem) -> None:
    if not item.prefix.endswith("\n"):
        raise _LineError("prefix must end at the end of a line (with a newline)")
    if "\n" in item.next_line:
        raise _LineError("next_line must be a single line")
    if item.next_line != item.next_line.rstrip():
        raise _LineError("next_line has trailing whitespace")


# --- Prompts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskPrompt:
    """What the engine receives for one item: chat ``messages`` or raw ``text`` (exactly one is set)."""

    messages: tuple[Mapping[str, str], ...] | None = None
    text: str | None = None


def voice_messages(item: VoiceItem) -> list[dict[str, str]]:
    """The voice workload's prompt: the assistant system prompt + VOICE_SUFFIX, then the question."""
    return [
        {"role": "system", "content": system_prompt() + VOICE_SUFFIX},
        {"role": "user", "content": item.question},
    ]


def dialogue_messages(item: DialogueItem) -> list[dict[str, str]]:
    """The dialogue workload's prompt: the assistant system prompt, then the whole conversation."""
    return [
        {"role": "system", "content": system_prompt()},
        *({"role": m.role, "content": m.content} for m in item.messages),
    ]


def translation_messages(item: TranslationItem) -> list[dict[str, str]]:
    """The translation workload's prompt: TRANSLATION_SYSTEM, then the English source."""
    return [{"role": "system", "content": TRANSLATION_SYSTEM}, {"role": "user", "content": item.source}]


def code_text(item: CodeItem) -> str:
    """The raw completion prompt of a code item: its prefix without the newlines it ends with.

    The model then writes the line break(s) and the next line's indentation itself: SmolLM2's
    tokenizer merges a newline with the indentation after it, so a prompt that ended with the
    newline would cut that token in two, and the model rarely writes an indented line after it.
    """
    return item.prefix.rstrip("\n")


def build_prompt(item: TaskItem) -> TaskPrompt:
    """The prompt of any task item, as its workload builds it."""
    if isinstance(item, VoiceItem):
        return TaskPrompt(messages=tuple(voice_messages(item)))
    if isinstance(item, DialogueItem):
        return TaskPrompt(messages=tuple(dialogue_messages(item)))
    if isinstance(item, TranslationItem):
        return TaskPrompt(messages=tuple(translation_messages(item)))
    return TaskPrompt(text=code_text(item))


def set_name(item: TaskItem) -> str:
    """The task set an item belongs to."""
    if isinstance(item, VoiceItem):
        return "voice"
    if isinstance(item, DialogueItem):
        return "dialogue"
    if isinstance(item, CodeItem):
        return "code"
    return "translation"


def max_new_tokens(item: TaskItem, tokenizer: ChatTokenizer) -> int:
    """Output budget: 48 voice, 48 dialogue, 32 code; translation: the workload's source-length rule."""
    if isinstance(item, VoiceItem):
        return VOICE_MAX_TOKENS
    if isinstance(item, DialogueItem):
        return DIALOGUE_MAX_TOKENS
    if isinstance(item, CodeItem):
        return CODE_MAX_TOKENS
    cap = get_workload("translation").max_tokens
    return translation_budget_tokens(len(tokenizer.encode(item.source)), cap)


def prepare_task_item(item: TaskItem, tokenizer: ChatTokenizer) -> PreparedRequest:
    """Tokenise one item the way ``workloads.prepare_item`` does (chat template, or raw text)."""
    prompt = build_prompt(item)
    if prompt.messages is not None:
        ids = tokenizer.encode_chat([dict(m) for m in prompt.messages], add_generation_prompt=True)
    else:
        ids = tokenizer.encode(prompt.text or "", add_special_tokens=False)
    return PreparedRequest(
        key=item.id,
        workload=set_name(item),
        prompt_token_ids=tuple(ids),
        max_tokens=max_new_tokens(item, tokenizer),
        reference=item.references[0] if isinstance(item, TranslationItem) else None,
        source_text=source_text(item),
    )


def source_text(item: TaskItem) -> str:
    """What a user would say or type for this item: the question, the last user turn, the code
    prefix or the English source."""
    if isinstance(item, VoiceItem):
        return item.question
    if isinstance(item, DialogueItem):
        return item.messages[-1].content
    if isinstance(item, CodeItem):
        return code_text(item)
    return item.source


# --- Answer matching (voice, dialogue) --------------------------------------------------------

_ONES = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen".split()
    )
}
_TENS = {
    w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)
}


def _number_words_to_digits(tokens: Sequence[str]) -> list[str]:
    """Spelled numbers 0-999 ("twenty four", "two hundred and six", "a hundred") as digits."""
    out: list[str] = []
    i = 0

    def tens_ones(j: int) -> tuple[int, int] | None:  # (value, tokens used) of "forty two", "seven"...
        if j < len(tokens) and tokens[j] in _TENS:
            value = _TENS[tokens[j]]
            if j + 1 < len(tokens) and tokens[j + 1] in _ONES and 0 < _ONES[tokens[j + 1]] < 10:
                return value + _ONES[tokens[j + 1]], 2
            return value, 1
        if j < len(tokens) and tokens[j] in _ONES:
            return _ONES[tokens[j]], 1
        return None

    while i < len(tokens):
        head = tens_ones(i)
        hundreds = None
        if (
            head is not None
            and head[0] in range(1, 10)
            and i + head[1] < len(tokens)
            and tokens[i + head[1]] == "hundred"
        ):
            hundreds, used = head[0] * 100, head[1] + 1
        elif tokens[i] == "hundred":
            hundreds, used = 100, 1
        if hundreds is not None:
            j = i + used
            j_and = j + 1 if j < len(tokens) and tokens[j] == "and" else j
            rest = tens_ones(j_and)
            if rest is not None and 0 < rest[0] < 100:
                hundreds, j = hundreds + rest[0], j_and + rest[1]
            out.append(str(hundreds))
            i = j
        elif head is not None:
            out.append(str(head[0]))
            i += head[1]
        else:
            out.append(tokens[i])
            i += 1
    return out


def normalise_answer(text: str) -> str:
    """Lower case, accents and punctuation removed, whitespace collapsed, number words as digits.

    "Twenty-Four!" -> "24", "Café, s'il vous plaît" -> "cafe sil vous plait", "1,000" -> "1000",
    "4:30pm" -> "4 30 pm", "B17" -> "b 17", "3.5" and "three point five" -> "3 point 5".
    """
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # thousands separators
    text = re.sub(r"(?<=\d)\.(?=\d)", " point ", text)  # decimal points
    text = re.sub(r"['\u2019\u2018`]", "", text)  # apostrophes join: "don't" -> "dont"
    text = re.sub(r"[\W_]+", " ", text)
    text = re.sub(r"(?<=\d)(?=[^\W\d])|(?<=[^\W\d])(?=\d)", " ", text)  # "5pm" -> "5 pm", "b17" -> "b 17"
    return " ".join(_number_words_to_digits(text.split()))


def contains_answer(reply: str, answers: Sequence[str]) -> bool:
    """Whether any accepted answer occurs in ``reply``, normalised, on word boundaries."""
    haystack = f" {normalise_answer(reply)} "
    for answer in answers:
        needle = normalise_answer(answer)
        if needle and f" {needle} " in haystack:
            return True
    return False


# --- Code matching ----------------------------------------------------------------------------


def first_line(text: str) -> str:
    """The first line of ``text`` holding anything but whitespace, with trailing whitespace
    stripped and indentation kept; "" if there is none."""
    for line in text.splitlines():
        if line.strip():
            return line.rstrip()
    return ""


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len(a), len(b)) on the lines with trailing whitespace stripped.

    1 for identical lines (two empty lines included), 0 when nothing can be kept.
    """
    a, b = a.rstrip(), b.rstrip()
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def exact_match(a: str, b: str) -> bool:
    """Whether two lines are equal once trailing whitespace is stripped (indentation counts)."""
    return a.rstrip() == b.rstrip()


# --- Translation metrics ----------------------------------------------------------------------


def _reference_streams(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> Any:
    """Per-item reference lists -> sacrebleu's reference streams, padded with None (variable count).

    sacrebleu skips None references; its type hints do not say so, hence ``Any``.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every hypothesis needs at least one reference")
    width = max((len(refs) for refs in references), default=1)
    return [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]


def chrf_item_statistics(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]]
) -> list[tuple[int, ...]]:
    """Per-item chrF sufficient statistics (sacrebleu's, best reference per item).

    Corpus chrF is a function of the sum of these rows, so it can be recomputed for any
    resample of the items (``chrf_from_item_statistics``).
    """
    from sacrebleu.metrics import CHRF

    rows = CHRF()._extract_corpus_statistics(list(hypotheses), _reference_streams(hypotheses, references))
    return [tuple(int(v) for v in row) for row in rows]


def chrf_from_item_statistics(rows: Sequence[Sequence[int]]) -> float:
    """Corpus chrF (0..100) from per-item statistics rows (summed)."""
    from sacrebleu.metrics import CHRF

    total = [sum(col) for col in zip(*rows, strict=True)]
    return float(CHRF()._compute_score_from_stats(total).score)


def chrf_score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus chrF (sacrebleu defaults: character 6-grams, beta 2) against per-item reference lists."""
    import sacrebleu

    return float(sacrebleu.corpus_chrf(list(hypotheses), _reference_streams(hypotheses, references)).score)


def bleu_score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (sacrebleu defaults, 13a tokenisation) against per-item reference lists."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), _reference_streams(hypotheses, references)).score)


# --- Per-item scores --------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerScore:
    """A voice item's score: 1 if the reply contains an accepted answer, else 0."""

    id: str
    correct: int
    reply: str


@dataclass(frozen=True)
class DialogueScore:
    """A dialogue item's score (as voice), with the distance it tests."""

    id: str
    distance_turns: int
    correct: int
    reply: str


@dataclass(frozen=True)
class CodeScore:
    """A code item's score: exact match (0/1) and edit similarity of the first generated line."""

    id: str
    exact: int
    edit_similarity: float
    line: str  # the first non-empty generated line


@dataclass(frozen=True)
class TranslationScore:
    """A translation item's chrF sufficient statistics (summable into corpus chrF)."""

    id: str
    chrf_statistics: tuple[int, ...]
    hypothesis: str


def score_voice(item: VoiceItem, reply: str) -> AnswerScore:
    """Score one voice reply by normalised containment of an accepted answer."""
    return AnswerScore(item.id, int(contains_answer(reply, item.answers)), reply)


def score_dialogue(item: DialogueItem, reply: str) -> DialogueScore:
    """Score one dialogue reply by normalised containment of an accepted answer."""
    return DialogueScore(item.id, item.distance_turns, int(contains_answer(reply, item.answers)), reply)


def score_code(item: CodeItem, completion: str) -> CodeScore:
    """Score a raw completion by its first non-empty line against ``next_line``."""
    line = first_line(completion)
    return CodeScore(
        item.id, int(exact_match(line, item.next_line)), edit_similarity(line, item.next_line), line
    )


def score_translation(item: TranslationItem, hypothesis: str) -> TranslationScore:
    """Per-item chrF statistics of one translation against the item's references."""
    (row,) = chrf_item_statistics([hypothesis.strip()], [item.references])
    return TranslationScore(item.id, row, hypothesis)


ItemScore = AnswerScore | DialogueScore | CodeScore | TranslationScore


def score_item(item: TaskItem, output: str) -> ItemScore:
    """Score one generated text by its item's set."""
    if isinstance(item, VoiceItem):
        return score_voice(item, output)
    if isinstance(item, DialogueItem):
        return score_dialogue(item, output)
    if isinstance(item, CodeItem):
        return score_code(item, output)
    return score_translation(item, output)


# --- Retention with a paired bootstrap over items ---------------------------------------------


@dataclass(frozen=True)
class RatioInterval:
    """Retention = optimised score / full score on the same items, capped at 1, with a paired
    bootstrap percentile interval (capped like the point value).

    ``optimised_score`` and ``full_score`` are means of per-item scores (or corpus chrF);
    ``uncapped`` is the ratio without the cap; ``low``/``high`` bound the central ``level`` share
    of the resampled ratios.
    """

    n: int
    optimised_score: float
    full_score: float
    ratio: float
    uncapped: float
    low: float
    high: float
    level: float
    resamples: int


def _resample_counts(n: int, resamples: int, seed: int) -> Any:
    import numpy as np

    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return np.stack([np.bincount(d, minlength=n) for d in draws]).astype(np.float64)  # [resamples, n]


def _check_bootstrap(n_opt: int, n_full: int, resamples: int, level: float) -> None:
    if n_opt != n_full:
        raise ValueError(f"paired scores need as many optimised ({n_opt}) as full ({n_full}) items")
    if n_opt == 0:
        raise ValueError("no items to score")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def _interval(
    n: int, opt_score: float, full_score: float, ratios: Any, level: float, resamples: int
) -> RatioInterval:
    import numpy as np

    point = 1.0 if full_score <= 0 else opt_score / full_score
    tail = 100 * (1 - level) / 2
    low, high = (float(v) for v in np.percentile(ratios, [tail, 100 - tail]))
    return RatioInterval(
        n=n,
        optimised_score=opt_score,
        full_score=full_score,
        ratio=min(1.0, point),
        uncapped=point,
        low=min(1.0, low),
        high=min(1.0, high),
        level=level,
        resamples=resamples,
    )


def paired_ratio_interval(
    optimised: Sequence[float],
    full: Sequence[float],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Retention min(1, mean(optimised) / mean(full)) of per-item scores, paired bootstrap interval.

    Each resample draws items with replacement and scores both configurations on the *same*
    draw. A resample (or the whole set) where the full model scores 0 counts as ratio 1, as
    ``quality.retention_ratio`` does. Identical scores give exactly 1 with interval [1, 1].
    """
    import numpy as np

    _check_bootstrap(len(optimised), len(full), resamples, level)
    opt, ref = np.asarray(optimised, dtype=np.float64), np.asarray(full, dtype=np.float64)
    n = len(opt)
    counts = _resample_counts(n, resamples, seed)
    opt_sums, full_sums = counts @ opt, counts @ ref
    ratios = np.where(full_sums > 0, opt_sums / np.where(full_sums > 0, full_sums, 1.0), 1.0)
    return _interval(n, float(opt.sum() / n), float(ref.sum() / n), ratios, level, resamples)


def paired_chrf_ratio_interval(
    optimised: Sequence[Sequence[int]],
    full: Sequence[Sequence[int]],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> RatioInterval:
    """Retention of corpus chrF from per-item statistics rows (``TranslationScore.chrf_statistics``).

    Each resample sums the rows of the same drawn items for both configurations and scores the
    sums; the scores reported are corpus chrF (0..100).
    """
    import numpy as np

    _check_bootstrap(len(optimised), len(full), resamples, level)
    opt, ref = np.asarray(optimised, dtype=np.int64), np.asarray(full, dtype=np.int64)
    counts = _resample_counts(len(opt), resamples, seed).astype(np.int64)
    opt_sums, full_sums = counts @ opt, counts @ ref
    ratios = np.empty(resamples)
    for b in range(resamples):
        f = chrf_from_item_statistics([full_sums[b]])
        ratios[b] = 1.0 if f <= 0 else chrf_from_item_statistics([opt_sums[b]]) / f
    opt_score, full_score = chrf_from_item_statistics(optimised), chrf_from_item_statistics(full)
    return _interval(len(opt), opt_score, full_score, ratios, level, resamples)
