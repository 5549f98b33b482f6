"""The model's linears in the transposed layout (rag_accel/linears.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder, linears


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 2, 64), (1, 3, 64), (2, 5, 64), (17, 64)])
def test_transposed_linear_equals_linear(shape):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(*shape, generator=g), torch.randn(300, 64, generator=g)
    got = linears.transposed_linear(hidden, weight)
    assert got.shape == (*shape[:-1], 300)
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)


class _Count:
    """Rows of every product that took the transposed layout, for the output projection and the rest."""

    def __init__(self, monkeypatch, model):
        self.head, self.inner = [], []
        head_weight = model.get_output_embeddings().weight
        real = linears.transposed_linear

        def counting(hidden, weight):
            (self.head if weight is head_weight else self.inner).append(hidden.numel() // hidden.shape[-1])
            return real(hidden, weight)

        monkeypatch.setattr(linears, "transposed_linear", counting)

    def clear(self):
        self.head.clear()
        self.inner.clear()


def _inner_linears(model):
    head = model.get_output_embeddings()
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.bias is None and m is not head]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_forwards_take_the_transposed_layout_and_stay_exact(arch, tokenizer, monkeypatch):
    model = tiny_model(arch, vocab_size=len(tokenizer))
    n_inner = len(_inner_linears(model))
    assert n_inner == (14 if arch == "llama" else 0)  # GPT-2's projections are Conv1D: left alone
    count = _Count(monkeypatch, model)
    prompt = list(range(5, 45))
    want = hf_greedy(model, prompt, 30)
    for head, inner, mode, k in [(True, True, "right", 6), (True, True, "wrong", 3), (True, True, "mix", 3),
                                 (False, True, "mix", 3), (True, False, "mix", 3), (False, False, "mix", 6)]:
        cfg = DecoderConfig(adaptive=False, max_draft_tokens=k, fast_head=head, fast_linears=inner)
        dec = ReferenceDecoder(model, tokenizer, cfg)
        assert count.head == count.inner == []  # generate() and the decoder's setup: the model's own layout
        out = dec.generate(prompt, max_new_tokens=30, drafters=[OracleDrafter(want, len(prompt), mode, dec.vocab_size)])
        assert out.token_ids == want
        if head:  # prefill (last position only) and every step, each with its 1 + draft rows
            assert count.head[0] == 1 and len(count.head) == out.stats.steps
            assert max(count.head) == k + 1 and all(1 <= r <= k + 1 for r in count.head)
        else:
            assert count.head == []
        if inner and head:  # every layer projection of each 2-4 token step, nothing else (the prefill has 40)
            assert sorted(count.inner) == sorted(r for r in count.head[1:] if 2 <= r <= 4 for _ in range(n_inner))
            assert bool(count.inner) == (k == 3 and n_inner > 0)
        elif inner and n_inner:
            assert count.inner and set(count.inner) <= {2, 3, 4}
        else:
            assert count.inner == []
        count.clear()


def test_transposed_layout_is_off_outside_the_decoder_and_in_other_threads(tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    ReferenceDecoder(model, tokenizer)  # installs the wrappers
    assert linears.install(model)  # idempotent
    count = _Count(monkeypatch, model)
    with torch.no_grad():
        model(torch.arange(3, 6)[None])
    assert count.head == count.inner == []
    seen = []
    with linears.transposed_linears(), torch.no_grad():
        model(torch.arange(3, 6)[None])  # here: taken, 3 rows
        t = threading.Thread(target=lambda: seen.append(linears._ACTIVE.get()))
        t.start()
        t.join()
    assert count.head == [3] and count.inner == [3] * 14
    assert seen == [(False, False)] and linears._ACTIVE.get() == (False, False)
    # Training (gradients on) keeps the modules' own path even inside the block.
    with linears.transposed_linears():
        model(torch.arange(3, 6)[None])
    assert count.head == [3] and count.inner == [3] * 14


def test_other_modules_are_left_alone():
    class WithBias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.biased, self.plain = torch.nn.Linear(4, 4, bias=True), torch.nn.Linear(4, 4, bias=False)
            self.head = torch.nn.Linear(4, 6, bias=True)

        def get_output_embeddings(self):
            return self.head

    m = WithBias()
    assert not linears.install(m)  # the head has a bias: not ours to change
    assert "forward" not in vars(m.biased) and "forward" not in vars(m.head)
    assert vars(m.plain)["forward"].__func__ is linears.inner_forward
    assert not linears.install(object())
    half = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16))
    linears.install(half)
    assert "forward" not in vars(half[0])  # the layers' projections are wrapped only on a CPU in float32


def test_a_copied_model_projects_with_its_own_weights(tokenizer):
    import copy

    model = tiny_model("llama", vocab_size=len(tokenizer))
    assert linears.install(model)
    twin = copy.deepcopy(model)
    for m in [twin.get_output_embeddings(), *_inner_linears(twin)]:
        assert m.forward.__self__ is m
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2.0)
        x = torch.arange(3, 6)[None]
        with linears.transposed_linears():
            torch.testing.assert_close(twin(x).logits, 2.0 * model(x).logits, rtol=1e-5, atol=1e-5)


def test_each_forward_path_is_timed_on_its_own(tokenizer, monkeypatch):
    """The adaptive policy's cost curve is measured on the path a request runs: a request with
    ``fast_head=False`` or ``fast_linears=False`` does not inherit the (cheaper) curve of the default."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(max_draft_tokens=4))
    count = _Count(monkeypatch, model)
    prompt = list(range(5, 25))
    first = dec.generate(prompt, max_new_tokens=3)
    pack = dec.config.pack_gqa
    assert first.stats.calibration_s > 0 and set(dec._cost_curves) == {(4, pack, True, True)}
    assert {2, 4, 5} <= set(count.head) and {2, 4} <= set(count.inner)  # the curve's forwards took both
    assert dec.generate(prompt, max_new_tokens=3).stats.calibration_s == 0  # measured once
    count.clear()
    plain_head = dec.generate(prompt, max_new_tokens=3, config={"fast_head": False})
    assert plain_head.stats.calibration_s > 0 and count.head == []  # timed and decoded on the model's projection
    count.clear()
    plain_inner = dec.generate(prompt, max_new_tokens=3, config={"fast_linears": False})
    assert plain_inner.stats.calibration_s > 0 and count.inner == []
    assert set(dec._cost_curves) == {(4, pack, True, True), (4, pack, False, True), (4, pack, True, False)}
    assert plain_head.token_ids == plain_inner.token_ids == first.token_ids == hf_greedy(model, prompt, 3)


def test_forwards_outside_2_to_4_tokens_skip_the_layers_row_checks(tokenizer, monkeypatch):
    """The decoder decides per forward, so one-token steps (most of a decode) pay no per-module check."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=6))
    head_weight = model.get_output_embeddings().weight
    checked, real = [], linears._fast

    def counting(weight, hidden, rows):
        if weight is not head_weight:
            checked.append(hidden.numel() // hidden.shape[-1])
        return real(weight, hidden, rows)

    monkeypatch.setattr(linears, "_fast", counting)
    prompt = list(range(5, 45))
    out = dec.generate(prompt, max_new_tokens=12, drafters=[])  # no drafts: the prefill, then one-token steps
    assert out.token_ids == hf_greedy(model, prompt, 12) and checked == []
    with linears.transposed_linears(), torch.no_grad():
        model(torch.arange(3, 6)[None])
    assert checked == [3] * 14
