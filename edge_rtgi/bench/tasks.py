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
The scorers themselves are in ``edge_rtgi.scoring.text``, and retention with its paired bootstrap
interval over items in ``edge_rtgi.scoring.retention`` (``paired_ratio_interval`` for per-item
scores, ``paired_chrf_ratio_interval`` for chrF).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
from edge_rtgi.scoring.text import chrf_statistics, contains_answer, edit_similarity, exact_match, first_line

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
    (row,) = chrf_statistics([hypothesis.strip()], [item.references])
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
