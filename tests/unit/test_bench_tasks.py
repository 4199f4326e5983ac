"""Graded task sets: loading (strict), prompts, scorers and the paired retention bootstrap. No model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import sacrebleu

from edge_rtgi.bench import tasks
from edge_rtgi.bench.tasks import (
    CodeItem,
    DialogueItem,
    Message,
    TranslationItem,
    VoiceItem,
    build_prompt,
    load_task_set,
    score_code,
    score_dialogue,
    score_translation,
    score_voice,
)
from edge_rtgi.bench.workloads import TRANSLATION_SYSTEM, VOICE_SUFFIX, get_workload, system_prompt
from edge_rtgi.errors import ConfigError
from edge_rtgi.scoring.retention import paired_chrf_ratio_interval, paired_ratio_interval
from edge_rtgi.scoring.text import (
    bleu_score,
    chrf_from_statistics,
    chrf_score,
    chrf_statistics,
    contains_answer,
    edit_similarity,
    exact_match,
    first_line,
    levenshtein,
    normalise_answer,
)
from tests.scripts import load_script

# --- Answer normalisation and containment -----------------------------------------------------


def test_containment_accepts_any_alias():
    assert contains_answer("The capital of France is Paris.", ["paris"])
    assert contains_answer("It is the colour purple.", ["purple", "violet"])
    assert contains_answer("Violet, I think.", ["purple", "violet"])
    assert not contains_answer("It is blue.", ["purple", "violet"])


def test_number_words_and_digits_match_both_ways():
    assert contains_answer("A spider has 8 legs.", ["eight"])
    assert contains_answer("A spider has eight legs.", ["8"])
    assert contains_answer("There are twenty-four hours in a day.", ["24"])
    assert contains_answer("Twenty four.", ["24"])
    assert contains_answer("It has 206 bones.", ["two hundred and six"])
    assert contains_answer("A hundred years.", ["100"])
    assert contains_answer("One hundred cents.", ["100"])
    assert contains_answer("Zero degrees.", ["0"])
    assert contains_answer("About 1,000 grams.", ["1000"])
    assert not contains_answer("A spider has 10 legs.", ["eight", "8"])


def test_containment_is_on_word_boundaries():
    assert not contains_answer("I often go there.", ["ten"])
    assert not contains_answer("It costs 100 euros.", ["10"])
    assert not contains_answer("Parisian cafes are nice.", ["paris"])
    assert not contains_answer("Seventy.", ["seven"])
    assert contains_answer("It is ten.", ["ten"])
    assert contains_answer("Blue whale!", ["blue whale"])
    assert not contains_answer("A blue, big whale.", ["blue whale"])


def test_accents_punctuation_and_case_are_ignored():
    assert normalise_answer("  Café, S'il VOUS plaît!  ") == "cafe sil vous plait"
    assert contains_answer("Se llama José.", ["jose"])
    assert contains_answer("It is BOGOTÁ.", ["Bogota"])
    assert contains_answer("Meet at 4:30 p.m.", ["four thirty"])
    assert contains_answer("Gate B17, I believe.", ["b17"])
    assert normalise_answer("Twenty-Four!") == "24"
    assert normalise_answer("3.5 and three point five") == "3 point 5 and 3 point 5"
    assert normalise_answer("") == ""


def test_empty_answer_never_matches():
    assert not contains_answer("anything", ["", "  ", "!"])


# --- Code line matching -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("intention", "execution", 5),
        ("return x", "return x", 0),
        ("return x", "return y", 1),
    ],
)
def test_levenshtein_known_cases(a, b, distance):
    assert levenshtein(a, b) == distance
    assert levenshtein(b, a) == distance


def test_edit_similarity_on_hand_made_pairs():
    assert edit_similarity("    return a + b", "    return a + b") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_similarity("abc", "xyz") == 0.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("return x   ", "return x") == 1.0  # trailing whitespace is stripped
    assert edit_similarity("    return x", "return x") == pytest.approx(1 - 4 / 12)  # indentation counts


def test_exact_match_strips_trailing_whitespace_only():
    assert exact_match("    return x  ", "    return x")
    assert not exact_match("return x", "    return x")


def test_first_line_skips_blank_lines_and_keeps_indentation():
    assert first_line("\n\n    return a + b\n    print(x)") == "    return a + b"
    assert first_line("x = 1") == "x = 1"
    assert first_line("   \n\t\n  y = 2   \nz") == "  y = 2"
    assert first_line("") == ""
    assert first_line("\n  \n") == ""


def test_score_code_uses_the_first_generated_line():
    item = CodeItem("code-x", "def add(a, b):\n", "    return a + b")
    exact = score_code(item, "\n    return a + b\n\nprint(add(1, 2))")
    assert (exact.exact, exact.edit_similarity, exact.line) == (1, 1.0, "    return a + b")
    near = score_code(item, "\n    return a+b\n")
    assert near.exact == 0 and near.edit_similarity == pytest.approx(1 - 2 / 16)
    assert score_code(item, "").edit_similarity == 0.0


# --- Translation metrics ----------------------------------------------------------------------

HYPS = ["El gato está en la mesa.", "Buenos días a todos", "Necesito un médico ahora."]
REFS = [["El gato está sobre la mesa."], ["Buenos días, ¿cómo estás?"], ["Necesito un médico."]]


def test_chrf_equals_sacrebleu_corpus_chrf():
    expected = sacrebleu.corpus_chrf(HYPS, [[r[0] for r in REFS]]).score
    assert chrf_score(HYPS, REFS) == pytest.approx(expected, abs=1e-9)
    assert chrf_from_statistics(chrf_statistics(HYPS, REFS)) == pytest.approx(expected, abs=1e-9)


def test_chrf_with_a_variable_number_of_references():
    refs = [
        ["El gato está sobre la mesa.", "El gato está en la mesa."],
        ["Buenos días, ¿cómo estás?"],
        ["Necesito un médico."],
    ]
    streams = [[r[0] for r in refs], ["El gato está en la mesa.", None, None]]
    expected = sacrebleu.corpus_chrf(HYPS, streams).score
    assert chrf_score(HYPS, refs) == pytest.approx(expected, abs=1e-9)
    assert chrf_from_statistics(chrf_statistics(HYPS, refs)) == pytest.approx(expected, abs=1e-9)
    assert chrf_score(HYPS, refs) > chrf_score(HYPS, REFS)  # a matching second reference helps


def test_bleu_equals_sacrebleu_corpus_bleu():
    expected = sacrebleu.corpus_bleu(HYPS, [[r[0] for r in REFS]]).score
    assert bleu_score(HYPS, REFS) == pytest.approx(expected, abs=1e-9)
    assert bleu_score(["La casa es roja."], [["La casa es roja."]]) == pytest.approx(100.0)


def test_per_item_translation_statistics_sum_to_corpus_chrf():
    items = [TranslationItem(f"t{i}", "x", tuple(r)) for i, r in enumerate(REFS)]
    rows = [score_translation(item, hyp).chrf_statistics for item, hyp in zip(items, HYPS, strict=True)]
    assert chrf_from_statistics(rows) == pytest.approx(chrf_score(HYPS, REFS), abs=1e-9)


def test_metrics_refuse_mismatched_lengths_and_missing_references():
    with pytest.raises(ValueError, match="2 hypotheses but 1"):
        chrf_score(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="at least one reference"):
        chrf_score(["a"], [[]])


# --- Paired retention bootstrap ---------------------------------------------------------------


def test_identical_scores_give_exactly_one():
    full = [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    result = paired_ratio_interval(full, list(full))
    assert (result.ratio, result.uncapped, result.low, result.high) == (1.0, 1.0, 1.0, 1.0)
    assert result.n == 10 and result.optimised_score == result.full_score == 0.6


def test_halved_scores_give_exactly_one_half():
    full = [0.9, 0.3, 0.71, 1.0, 0.0, 0.55, 0.12, 0.8]
    result = paired_ratio_interval([s / 2 for s in full], full, resamples=500)
    assert (result.ratio, result.uncapped, result.low, result.high) == (0.5, 0.5, 0.5, 0.5)


def test_ratio_is_capped_and_interval_brackets_the_point():
    full = [1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    better = [1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 0]
    result = paired_ratio_interval(better, full)
    assert result.ratio == 1.0 and result.uncapped == pytest.approx(8 / 6)
    assert result.high == 1.0
    worse = [1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0]
    result = paired_ratio_interval(worse, full, seed=3)
    assert result.ratio == pytest.approx(4 / 6)
    assert result.low < result.ratio < result.high <= 1.0
    assert paired_ratio_interval(worse, full, seed=3) == result  # seeded


def test_full_model_scoring_zero_counts_as_no_loss():
    result = paired_ratio_interval([0, 0, 0], [0, 0, 0])
    assert (result.ratio, result.low, result.high) == (1.0, 1.0, 1.0)


def test_bootstrap_refuses_bad_input():
    with pytest.raises(ValueError, match="as many"):
        paired_ratio_interval([1, 0], [1])
    with pytest.raises(ValueError, match="no items"):
        paired_ratio_interval([], [])
    with pytest.raises(ValueError, match="level"):
        paired_ratio_interval([1], [1], level=1.5)


def test_chrf_ratio_interval_identical_and_degraded():
    items = [TranslationItem(f"t{i}", "x", tuple(r)) for i, r in enumerate(REFS * 4)]
    hyps = HYPS * 4
    full = [score_translation(item, h).chrf_statistics for item, h in zip(items, hyps, strict=True)]
    same = paired_chrf_ratio_interval(full, list(full), resamples=200)
    assert (same.ratio, same.uncapped, same.low, same.high) == (1.0, 1.0, 1.0, 1.0)
    assert same.full_score == pytest.approx(chrf_score(hyps, REFS * 4))
    worse_hyps = [h if i % 3 else "No sé." for i, h in enumerate(hyps)]
    worse = [score_translation(item, h).chrf_statistics for item, h in zip(items, worse_hyps, strict=True)]
    result = paired_chrf_ratio_interval(worse, full, resamples=200)
    assert result.ratio == pytest.approx(chrf_score(worse_hyps, REFS * 4) / chrf_score(hyps, REFS * 4))
    assert result.low <= result.ratio <= result.high < 1.0


# --- Prompts ----------------------------------------------------------------------------------


def test_prompts_are_built_as_the_workloads_build_them():
    voice = build_prompt(VoiceItem("v", "what is the capital of france", ("paris",)))
    assert voice.messages == (
        {"role": "system", "content": system_prompt() + VOICE_SUFFIX},
        {"role": "user", "content": "what is the capital of france"},
    )
    dialogue = build_prompt(
        DialogueItem(
            "d",
            1,
            (
                Message("user", "My dog is Rex."),
                Message("assistant", "Nice."),
                Message("user", "What is my dog called?"),
            ),
            ("rex",),
        )
    )
    assert dialogue.messages[0] == {"role": "system", "content": system_prompt()}
    assert [m["role"] for m in dialogue.messages] == ["system", "user", "assistant", "user"]
    translation = build_prompt(TranslationItem("t", "Hello.", ("Hola.",)))
    assert translation.messages == (
        {"role": "system", "content": TRANSLATION_SYSTEM},
        {"role": "user", "content": "Hello."},
    )
    code = build_prompt(CodeItem("c", "import os\n\n\n", "def main():"))
    assert code.text == "import os" and code.messages is None  # the model writes the line breaks


class _FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):
        return [len(m["content"]) for m in messages]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_budgets_follow_the_task_rules():
    tok = _FakeTokenizer()
    voice = tasks.prepare_task_item(VoiceItem("v", "hi", ("x",)), tok)
    assert voice.max_tokens == 48 and voice.key == "v" and voice.workload == "voice"
    code = tasks.prepare_task_item(CodeItem("c", "x = 1\n", "y = 2"), tok)
    assert code.max_tokens == 32 and code.prompt_token_ids == tuple(ord(c) for c in "x = 1")
    source = "Hello there."  # 12 "tokens" -> ceil(1.5 * 12) + 8 = 26, under the workload's cap
    translation = tasks.prepare_task_item(TranslationItem("t", source, ("Hola.",)), tok)
    assert translation.max_tokens == 26 <= get_workload("translation").max_tokens
    long = tasks.prepare_task_item(TranslationItem("t", "x" * 200, ("y",)), tok)
    assert long.max_tokens == get_workload("translation").max_tokens


# --- Shipped sets -----------------------------------------------------------------------------


def test_every_shipped_set_loads_with_the_required_sizes():
    sizes = {name: len(load_task_set(name)) for name in tasks.TASK_SET_NAMES}
    assert sizes["voice"] >= 150 and sizes["code"] >= 150 and sizes["translation"] >= 150
    assert sizes["dialogue"] >= 120
    distances = Counter(item.distance_turns for item in load_task_set("dialogue").items)
    assert set(distances) == set(tasks.DIALOGUE_DISTANCES)
    assert all(distances[d] >= 30 for d in tasks.DIALOGUE_DISTANCES)


def test_shipped_voice_questions_are_asr_style_and_do_not_give_the_answer_away():
    for item in load_task_set("voice").items:
        assert item.question == item.question.lower() and item.question.replace(" ", "").isalnum(), item.id
        assert not contains_answer(item.question, item.answers), item.id


def test_shipped_dialogues_state_the_fact_at_the_given_distance():
    for item in load_task_set("dialogue").items:
        fact = len(item.messages) - 1 - 2 * item.distance_turns  # the user turn that states the fact
        holding = [k for k, m in enumerate(item.messages) if contains_answer(m.content, item.answers)]
        # stated by the user, confirmed by the assistant's reply, and nowhere else (not in the question)
        assert holding == [fact, fact + 1], item.id
        assert item.messages[fact].role == "user"


def test_shipped_code_items_are_complete_lines():
    for item in load_task_set("code").items:
        assert item.prefix.endswith("\n") and item.next_line.strip(), item.id


def test_scorers_on_shipped_items():
    voice = load_task_set("voice").items[0]
    assert score_voice(voice, f"It is {voice.answers[0]}.").correct == 1
    assert score_voice(voice, "I do not know.").correct == 0
    dialogue = load_task_set("dialogue").items[0]
    assert score_dialogue(dialogue, f"You said {dialogue.answers[0]}.").correct == 1
    assert score_dialogue(dialogue, "You did not say.").distance_turns == dialogue.distance_turns


# --- Strict loading ---------------------------------------------------------------------------


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _voice(i: int, **fields) -> str:
    return json.dumps(
        {"id": f"voice-{i:03d}", "question": "what is one plus one", "answers": ["two"], **fields}
    )


def test_loads_a_good_file_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [_voice(1), "", _voice(2)])
    loaded = load_task_set("voice", path)
    assert loaded.name == "voice" and loaded.path == path
    assert loaded.items == (
        VoiceItem("voice-001", "what is one plus one", ("two",)),
        VoiceItem("voice-002", "what is one plus one", ("two",)),
    )


def _refused(name: str, path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_task_set(name, path)
    return str(info.value)


def test_missing_answer_is_refused_naming_file_line_and_reason(tmp_path):
    path = _write(tmp_path, [_voice(1), json.dumps({"id": "voice-002", "question": "what is two plus two"})])
    message = _refused("voice", path)
    assert str(path) in message and "line 2" in message and "missing field answers" in message


def test_empty_answers_list_is_refused(tmp_path):
    path = _write(tmp_path, [_voice(1, answers=[])])
    message = _refused("voice", path)
    assert str(path) in message and "line 1" in message and "answers is an empty list" in message


def test_duplicate_id_is_refused(tmp_path):
    path = _write(tmp_path, [_voice(1), _voice(2), _voice(1)])
    message = _refused("voice", path)
    assert (
        str(path) in message
        and "line 3" in message
        and "duplicate id 'voice-001' (first on line 1)" in message
    )


def test_malformed_line_is_refused(tmp_path):
    path = _write(tmp_path, [_voice(1), '{"id": "voice-002", "question": "x", "answers": ["y"]', _voice(3)])
    message = _refused("voice", path)
    assert str(path) in message and "line 2" in message and "malformed JSON" in message


def test_unknown_field_and_wrong_types_are_refused(tmp_path):
    assert "unknown field answer" in _refused("voice", _write(tmp_path, [_voice(1, answer="two")]))
    assert "answers[0] must be a non-empty string" in _refused(
        "voice", _write(tmp_path, [_voice(1, answers=[2])])
    )
    assert "question is empty" in _refused("voice", _write(tmp_path, [_voice(1, question=" ")]))
    assert "expected a JSON object" in _refused("voice", _write(tmp_path, ["[1, 2]"]))


def test_missing_next_line_and_reference_are_refused(tmp_path):
    code = _write(tmp_path, [json.dumps({"id": "code-001", "prefix": "x = 1\n"})])
    assert "line 1" in (m := _refused("code", code)) and "missing field next_line" in m
    translation = _write(tmp_path, [json.dumps({"id": "t-1", "source": "Hi.", "references": []})])
    assert "references is an empty list" in _refused("translation", translation)
    assert "must end at the end of a line" in _refused(
        "code", _write(tmp_path, [json.dumps({"id": "c", "prefix": "x = 1", "next_line": "y"})])
    )


def test_malformed_dialogues_are_refused(tmp_path):
    def dialogue(messages, distance=1):
        return json.dumps({"id": "d", "distance_turns": distance, "messages": messages, "answers": ["rex"]})

    u, a = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    assert "must alternate" in _refused("dialogue", _write(tmp_path, [dialogue([u, u, u])]))
    assert "last message must be the user's" in _refused("dialogue", _write(tmp_path, [dialogue([u, a])]))
    assert "distance_turns 2 must be between 1 and" in _refused(
        "dialogue", _write(tmp_path, [dialogue([u, a, u], 2)])
    )
    assert "role must be user or assistant" in _refused(
        "dialogue", _write(tmp_path, [dialogue([{"role": "system", "content": "x"}, a, u])])
    )
    assert "distance_turns must be an integer" in _refused(
        "dialogue", _write(tmp_path, [dialogue([u, a, u], "1")])
    )


def test_missing_file_empty_file_and_unknown_set_are_refused(tmp_path):
    assert "does not exist" in _refused("voice", tmp_path / "nope.jsonl")
    assert "has no items" in _refused("voice", _write(tmp_path, [""]))
    with pytest.raises(ConfigError, match="unknown task set 'poetry'"):
        load_task_set("poetry")


# --- Scripts ----------------------------------------------------------------------------------


def test_shipped_dialogues_are_what_the_generator_makes(tmp_path):
    make = load_script("make_dialogue_tasks")
    out = tmp_path / "dialogue.jsonl"
    assert make.main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == tasks.task_set_path("dialogue").read_text(encoding="utf-8")


def test_calibration_summaries():
    calibrate = load_script("calibrate_tasks")
    assert calibrate.parse_sets("voice, code") == ["voice", "code"]
    with pytest.raises(Exception, match="unknown task set"):
        calibrate.parse_sets("voice,poetry")
    dialogue = load_task_set("dialogue")
    scores = [
        score_dialogue(item, f"It is {item.answers[0]}." if k % 2 else "No idea.")
        for k, item in enumerate(dialogue.items)
    ]
    summary = calibrate.summarise(dialogue, scores, [s.reply for s in scores])
    assert summary.n == len(dialogue) and summary.score == pytest.approx(50.0, abs=1.0)
    assert any("distance 30" in line for line in summary.lines)
    translation = load_task_set("translation")
    items = translation.items[:5]
    outputs = [item.references[0] for item in items]
    scores = [score_translation(item, o) for item, o in zip(items, outputs, strict=True)]
    summary = calibrate.summarise(translation, scores, outputs)
    assert summary.score == pytest.approx(100.0) and "BLEU=100.0" in summary.lines[0]
