"""Quality-retention maths: KL is exactly 0 for identical models and positive for a perturbed one."""

import copy
import math

import pytest
import torch

from edge_rtgi.bench.quality import kl_along_continuations, kl_rows, model_logits_fn
from edge_rtgi.llm.generate import generate
from edge_rtgi.llm.sampling import SamplingParams
from edge_rtgi.llm.weights import load_model
from edge_rtgi.scoring.retention import chrf, score_outputs
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    folder = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"), seed=3)
    return load_model(folder, device="cpu", dtype="fp32")


def _sequences(loaded, n=3, new_tokens=8):
    seqs = []
    for i, text in enumerate(["Hello! How are you", "The quick brown fox", "def add(a, b):"][:n]):
        prompt = loaded.tokenizer.encode(text)
        out = generate(loaded, prompt, SamplingParams(max_tokens=new_tokens + i, ignore_eos=True))
        seqs.append((prompt, out.token_ids))
    return seqs


def test_kl_is_exactly_zero_for_identical_models(tiny):
    seqs = _sequences(tiny)
    result = kl_along_continuations(model_logits_fn(tiny.model), model_logits_fn(tiny.model), seqs)
    assert result.mean == 0.0 and result.max == 0.0
    assert result.top1_agreement == 1.0
    assert result.num_tokens == sum(len(c) for _, c in seqs)
    # a separately built copy with the same weights is identical too
    twin = copy.deepcopy(tiny.model)
    assert kl_along_continuations(model_logits_fn(tiny.model), model_logits_fn(twin), seqs).mean == 0.0


def test_kl_is_positive_for_a_perturbed_model(tiny):
    seqs = _sequences(tiny)
    perturbed = copy.deepcopy(tiny.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = perturbed.layers[0].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=gen) * 0.05)
    result = kl_along_continuations(model_logits_fn(tiny.model), model_logits_fn(perturbed), seqs)
    assert result.mean > 0.0
    assert result.max >= result.p99 >= 0.0


def test_greedy_continuation_matches_teacher_forced_argmax(tiny):
    # the KL rows line up with the continuation: row len(prompt)-1 predicts its first token
    prompt, cont = _sequences(tiny, n=1)[0]
    logits = model_logits_fn(tiny.model)([*prompt, *cont])
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert predicted == cont


def test_kl_rows_known_value():
    p = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert float(kl_rows(p, q)[0]) == pytest.approx(expected, rel=1e-9)


def test_chrf_and_retention():
    texts = ["La sopa está caliente.", "Buenos días."]
    assert chrf(texts, texts) == 100.0
    assert chrf(["", ""], ["", ""]) == 100.0
    assert chrf(["El perro come."], ["La sopa está caliente."]) < 50.0
    q = score_outputs("voice", ["Paris is the capital."], ["Paris is the capital."])
    assert q.retention == 1.0 and q.chrf_agreement == 100.0
    q = score_outputs("translation", ["Buenos"], ["Buenos días."], references=["Buenos días."])
    assert 0.0 < q.retention < 1.0
    assert q.chrf_ref_full == 100.0
    # an optimised model better than the full one is capped at 1
    q = score_outputs("translation", ["Buenos días."], ["Buenos"], references=["Buenos días."])
    assert q.retention == 1.0
