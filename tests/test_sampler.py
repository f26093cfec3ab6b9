"""Sampler, sampling-parameter validation and incremental detokenization with stops."""

from __future__ import annotations

import pytest
import torch

from epd.errors import EPDError
from epd.llm.detokenizer import DetokState, IncrementalDetokenizer
from epd.llm.sampler import Sampler
from epd.llm.sampling_params import SamplingParams


def make_logits(n=4, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = make_logits()
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = make_logits()
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)]
    out = Sampler(torch.Generator().manual_seed(1))(logits[:2], params)
    assert out.token_ids == logits[:2].argmax(-1).tolist()


def test_seeded_requests_reproducible_regardless_of_batch():
    logits = make_logits(n=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(rows, params):
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        sampler = Sampler(torch.Generator().manual_seed(len(rows)))
        return [sampler(logits[rows], params, gens).token_ids for _ in range(20)]

    alone = run([0], [seeded])
    batched = run([1, 0, 2], [other, seeded, other])
    assert [t[0] for t in alone] == [t[1] for t in batched]
    assert len({t[0] for t in alone}) > 1  # it really samples


def test_top_k_restricts_support():
    logits = make_logits(n=1, vocab=30)
    top2 = set(logits[0].topk(2).indices.tolist())
    sampler = Sampler(torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=2.0, top_k=2)] * 64
    out = sampler(logits.expand(64, -1), params)
    assert set(out.token_ids) == top2


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(logits.expand(200, -1), [SamplingParams(temperature=1.0, top_p=0.7)] * 200)
    assert set(out.token_ids) == {0, 1}


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = make_logits(n=2)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params)
    lp = torch.log_softmax(logits[0], -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(lp.max().item(), abs=1e-5)
    assert [t for t, _ in first.top] == lp.topk(3).indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(lp.topk(3).values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"n": 2}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_validation_names_the_parameter(kwargs, param):
    with pytest.raises(EPDError) as err:
        SamplingParams(**kwargs).validate(100, 10)
    assert (err.value.param, err.value.status) == (param, 400)


def test_validation_context_length():
    SamplingParams(max_tokens=90).validate(100, 10)
    with pytest.raises(EPDError) as err:
        SamplingParams(max_tokens=91).validate(100, 10, prompt_param="messages")
    assert err.value.param == "messages"
    assert SamplingParams(stop="x").stop == ("x",)


class CharTokenizer:
    """Token i decodes to chr(i); 0xFF pairs emulate an incomplete UTF-8 sequence."""

    def decode(self, ids, skip_special_tokens=True):
        text, i = "", 0
        while i < len(ids):
            if ids[i] == 0xFF:
                text += "é" if i + 1 < len(ids) else "\ufffd"
                i += 2
                continue
            text += chr(ids[i])
            i += 1
        return text


def feed(text_ids, stop=()):
    det = IncrementalDetokenizer(CharTokenizer())
    state, ids, deltas, hit = DetokState(), [], [], None
    for t in text_ids:
        ids.append(t)
        det.append(state, ids)
        hit = det.find_stop(state, stop)
        deltas.append(det.emit(state, stop, final=hit is not None))
        if hit:
            break
    return deltas, state, hit


def test_detokenizer_holds_back_stop_prefixes_and_never_emits_the_stop():
    deltas, state, hit = feed([ord(c) for c in "ab<EN<END>zz"], stop=("<END>",))
    assert hit == "<END>"
    assert "".join(deltas) == "ab<EN" == state.text
    assert deltas[:3] == ["a", "b", ""]  # "<" held back while "<END>" may follow


def test_detokenizer_holds_back_incomplete_utf8():
    deltas, state, _ = feed([ord("a"), 0xFF, 0x00, ord("b")])
    assert "".join(deltas) == state.text == "aéb"
    assert "\ufffd" not in "".join(deltas)
