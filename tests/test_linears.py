"""Few-row projections in the layout measured fastest per weight shape (rag_accel/hf/linears.py)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import OracleDrafter, hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf import linears
from rag_accel.hf.linears import LinearPlan


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 2, 64), (1, 3, 64), (2, 5, 64), (17, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_plan_computes_the_linear(shape, bias):
    """Any row count, padded or not, in either layout, with a bias or without: F.linear's values."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(*shape, generator=g), torch.randn(300, 64, generator=g)
    b = torch.randn(300, generator=g) if bias else None
    want = torch.nn.functional.linear(hidden, weight, b)
    n = hidden.numel() // 64
    for rows in (n, n + 1, n + 7):
        for transposed in (False, True):
            plan = LinearPlan((0,) * n + (rows,), (False,) * n + (transposed,))
            got = linears.planned_linear(hidden, weight, b, plan)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_non_contiguous_rows_are_taken_as_they_are():
    """A transposed product's output feeding the next projection (strides (1, n)) is the same input."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 64, generator=g)
    hidden = torch.randn(64, 3, generator=g).t()  # [3, 64], not contiguous
    plan = LinearPlan((0, 1, 2, 3), (False, True, True, True))
    torch.testing.assert_close(linears.planned_linear(hidden, weight, None, plan),
                               torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)


def test_the_plan_takes_the_cheapest_layout_and_padding_only_past_the_margin():
    times = {(1, False): 3.0, (1, True): 1.5,     # one row: transposed, half the time
             (2, False): 6.0, (2, True): 2.0,     # two: transposed
             (3, False): 9.0, (3, True): 8.0,     # three: padded to four, transposed (2.2 < 0.95 x 9)
             (4, False): 5.0, (4, True): 2.2,
             (8, False): 4.0, (8, True): 3.9}     # eight: within the margin of the library's own: its own
    plan = LinearPlan.from_times(times)
    assert [(plan.rows[n], plan.transposed[n]) for n in (1, 2, 3, 4)] == [(1, True), (2, True), (4, True), (4, True)]
    # 5-7 rows are not measured: each is priced at its next measured count (8, 4.0) and stays as it is
    assert plan.rows[5:] == (0, 0, 0, 0) and len(plan.rows) == 9 and plan.changes
    assert not LinearPlan.from_times({(1, False): 1.0, (1, True): 0.99, (2, False): 1.0, (2, True): 1.2}).changes


def test_timing_covers_every_measured_row_count_in_both_layouts():
    mods = [torch.nn.Linear(32, 48) for _ in range(3)]
    times = linears.time_layouts(mods, rows=(1, 2, 5), repeats=1)
    assert set(times) == {(n, t) for n in (1, 2, 5) for t in (False, True)} and all(v > 0 for v in times.values())


class _Count:
    """Rows of every planned product (a plan that changes anything taken)."""

    def __init__(self, monkeypatch):
        self.rows = []
        real = linears.planned_linear

        def counting(hidden, weight, bias, plan):
            n = hidden.numel() // hidden.shape[-1]
            if n < len(plan.rows) and plan.rows[n]:
                self.rows.append(n)
            return real(hidden, weight, bias, plan)

        monkeypatch.setattr(linears, "planned_linear", counting)


def _transposed_everywhere(monkeypatch, upto=8):
    """Plans that change every row count 1..upto (the real plan depends on this machine's timing)."""
    plan = LinearPlan((0,) + tuple(range(1, upto + 1)), (False,) + (True,) * upto)
    monkeypatch.setattr("rag_accel.hf.steps.plan_linears",
                        lambda model: {shape: plan for shape in linears.linears(model)})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_decoder_forwards_take_their_plans_and_stay_exact(arch, tokenizer, monkeypatch):
    """Every projection of the decoder's steps (1 + draft rows) takes its plan, and the prefill's head (its last
    row); the prefill's 40 rows are past the plan, so its layers take the library's path. The output is generate's."""
    model = tiny_model(arch, vocab_size=len(tokenizer))
    _transposed_everywhere(monkeypatch)
    count = _Count(monkeypatch)
    prompt = list(range(5, 45))
    want = hf_greedy(model, prompt, 30)
    assert count.rows == []  # generate(): the model's own projections
    for fast, mode in [(True, "right"), (True, "wrong"), (False, "mix")]:
        dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=6))
        dec.steps.fast_linears = fast  # (a class constant; an experiment may set it on an instance)
        out = dec.generate(prompt, max_new_tokens=30, drafters=[OracleDrafter(want, len(prompt), mode, dec.vocab_size)])
        assert out.token_ids == want
        if fast:  # the prefill's 40 rows are past the plan (8 rows); every step's 1 + draft rows take it
            assert count.rows and set(count.rows) <= set(range(1, 8)) and 7 in count.rows
        else:
            assert count.rows == []
        count.rows.clear()
    assert hf_greedy(model, prompt, 30) == want and count.rows == []


def test_plans_are_off_outside_the_decoder_and_in_other_threads(tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    plan = LinearPlan((0, 1, 2, 3, 4, 5), (False, True, True, True, True, True))
    plans = {shape: plan for shape in linears.linears(model)}
    assert linears.install(model, plans) == len([m for m in model.modules() if type(m) is torch.nn.Linear])
    assert linears.install(model, plans)  # idempotent
    count = _Count(monkeypatch)
    with torch.no_grad():
        model(torch.arange(3, 8)[None])
    assert count.rows == []
    seen = []
    with linears.planned_linears(), torch.no_grad():
        model(torch.arange(3, 8)[None])  # here: taken, by each of the 2 layers' 7 projections and the head
        t = threading.Thread(target=lambda: seen.append(linears._ACTIVE.get()))
        t.start()
        t.join()
    assert count.rows == [5] * 15 and seen == [False] and not linears._ACTIVE.get()
    # Training (gradients on) keeps the modules' own path even inside the block.
    with linears.planned_linears():
        model(torch.arange(3, 8)[None])
    assert count.rows == [5] * 15


def test_a_plan_that_changes_nothing_wraps_nothing(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    same = LinearPlan((0, 0, 0), (False, False, False))
    assert linears.install(model, {shape: same for shape in linears.linears(model)}) == 0
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)


def test_a_copied_model_projects_with_its_own_weights(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    plan = LinearPlan((0, 2, 2, 4, 4, 8), (False, True, True, False, True, True))
    linears.install(model, {shape: plan for shape in linears.linears(model)})
    twin = copy.deepcopy(model)
    head = twin.get_output_embeddings()
    assert head.forward.__self__ is head
    with torch.no_grad():
        head.weight.mul_(2.0)
        x = torch.arange(3, 8)[None]
        with linears.planned_linears():
            torch.testing.assert_close(twin(x).logits, 2.0 * model(x).logits, rtol=1e-5, atol=1e-5)


def test_the_decoder_plans_once_on_its_model_and_each_path_is_timed_on_its_own(tokenizer, monkeypatch):
    """The plans are measured before the first cost curve, once; the policy's curve is measured on the path
    a request runs: with ``fast_linears`` off a request neither inherits the planned path's curve nor takes it."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    planned = []
    real = linears.plan_linears
    monkeypatch.setattr("rag_accel.hf.steps.plan_linears", lambda m: planned.append(m) or real(m))
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(max_draft_tokens=4))
    prompt = list(range(5, 25))
    first = dec.generate(prompt, max_new_tokens=3)
    fast_key = (4, dec.steps.pack_gqa, True, False)
    assert planned == [model] and first.stats.calibration_s > 0 and set(dec.steps.curves) == {fast_key}
    assert set(dec.plan_linears()) == set(linears.linears(model))  # every shape has its plan
    assert dec.generate(prompt, max_new_tokens=3).stats.calibration_s == 0  # measured once
    dec.steps.fast_linears = False
    count = _Count(monkeypatch)
    plain = dec.generate(prompt, max_new_tokens=3)
    assert plain.stats.calibration_s > 0 and planned == [model]
    assert set(dec.steps.curves) == {fast_key, (4, dec.steps.pack_gqa, False, False)}
    assert count.rows == []  # timed, and decoded, on the model's own projections
    assert plain.token_ids == first.token_ids == hf_greedy(model, prompt, 3)
