"""The output projection in the transposed layout (rag_accel/hf/lm_head.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import lm_head


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 2, 64), (1, 3, 64), (2, 5, 64), (17, 64)])
def test_transposed_linear_equals_linear(shape):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(*shape, generator=g), torch.randn(300, 64, generator=g)
    got = lm_head.transposed_linear(hidden, weight)
    assert got.shape == (*shape[:-1], 300)
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)


class _Count:
    def __init__(self, monkeypatch):
        self.rows = []
        real = lm_head.transposed_linear

        def counting(hidden, weight):
            self.rows.append(hidden.numel() // hidden.shape[-1])
            return real(hidden, weight)

        monkeypatch.setattr(lm_head, "transposed_linear", counting)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_forwards_take_the_transposed_head_and_stay_exact(arch, tokenizer, monkeypatch):
    model = tiny_model(arch, vocab_size=len(tokenizer))
    count = _Count(monkeypatch)
    prompt = list(range(5, 45))
    want = hf_greedy(model, prompt, 30)
    for fast, mode in [(True, "right"), (True, "wrong"), (False, "mix")]:
        dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=6))
        dec.fast_head = fast  # (a class constant; an experiment may set it on an instance)
        assert count.rows == []  # generate() and the decoder's setup: the model's own projection
        out = dec.generate(prompt, max_new_tokens=30, drafters=[OracleDrafter(want, len(prompt), mode, dec.vocab_size)])
        assert out.token_ids == want
        if fast:  # prefill (last position only) and every step, each with its 1 + draft rows
            assert count.rows[0] == 1 and len(count.rows) == out.stats.steps
            assert max(count.rows) == 7 and all(1 <= r <= 7 for r in count.rows)
        else:
            assert count.rows == []
        count.rows.clear()


def test_transposed_head_is_off_outside_the_decoder_and_in_other_threads(tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    ReferenceDecoder(model, tokenizer)  # installs the wrapper
    assert lm_head.install(model)  # idempotent
    count = _Count(monkeypatch)
    with torch.no_grad():
        model(torch.arange(3, 23)[None])
    assert count.rows == []
    seen = []
    with lm_head.transposed_head(), torch.no_grad():
        model(torch.arange(3, 8)[None])  # here: taken
        t = threading.Thread(target=lambda: seen.append(lm_head._ACTIVE.get()))
        t.start()
        t.join()
    assert count.rows == [5] and seen == [False] and not lm_head._ACTIVE.get()
    # Training (gradients on) keeps the module's own path even inside the block.
    with lm_head.transposed_head():
        model(torch.arange(3, 8)[None])
    assert count.rows == [5]


def test_other_heads_are_left_alone():
    class WithBias(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Linear(4, 6, bias=True)

    assert not lm_head.install(WithBias())
    assert not lm_head.install(object())


def test_a_copied_model_projects_with_its_own_weight(tokenizer):
    import copy

    model = tiny_model("llama", vocab_size=len(tokenizer))
    assert lm_head.install(model)
    twin = copy.deepcopy(model)
    assert twin.get_output_embeddings().forward.__self__ is twin.get_output_embeddings()
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2.0)
        x = torch.arange(3, 8)[None]
        with lm_head.transposed_head():
            torch.testing.assert_close(twin(x).logits, 2.0 * model(x).logits, rtol=1e-5, atol=1e-5)


def test_each_forward_path_is_timed_on_its_own(tokenizer, monkeypatch):
    """The adaptive policy's cost curve is measured on the path a request runs: a request with
    ``fast_head`` off does not inherit the (cheaper) curve of the transposed projection."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(max_draft_tokens=4))
    count = _Count(monkeypatch)
    prompt = list(range(5, 25))
    first = dec.generate(prompt, max_new_tokens=3)
    fast_key = (4, dec.pack_gqa, True)
    assert first.stats.calibration_s > 0 and set(dec._cost_curves) == {fast_key}
    assert {2, 4, 5} <= set(count.rows)  # the curve's multi-token forwards ran through the transposed head
    assert dec.generate(prompt, max_new_tokens=3).stats.calibration_s == 0  # measured once
    count.rows.clear()
    dec.fast_head = False
    plain = dec.generate(prompt, max_new_tokens=3)
    assert plain.stats.calibration_s > 0
    assert set(dec._cost_curves) == {fast_key, (4, dec.pack_gqa, False)}
    assert count.rows == []  # timed, and decoded, on the model's own projection
    assert plain.token_ids == first.token_ids == hf_greedy(model, prompt, 3)
