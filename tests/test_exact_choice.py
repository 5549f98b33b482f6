"""How vLLM's exact mode picks a projection's calls (rag_accel.vllm.exact.choose_linear), on fake row kernels whose
result depends on the rows a call holds exactly as told: the branches other CPUs take run here too (no vLLM needed).

A fake call of ``s`` rows computes ``x @ w.T`` plus an offset named by ``s``'s class: two calls of one class give a
row the same bits, calls of two classes other bits, as a library's kernels do when they pick another blocking.
"""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_verdicts

from rag_accel.vllm import exact
from rag_accel.vllm.exact import LARGE_CHUNK, MAX_CHUNK, PADDED_ROWS, LinearChoice, choose_linear


def fake_rows(weight: torch.Tensor, kind):
    """``rows(x, chunk, floor=1)`` as the oneDNN kernel's wrapper splits and pads, each call's rows offset by
    ``kind(rows in that call)`` (a number, or a column: one per place in the call)."""
    calls = []

    def rows(x: torch.Tensor, chunk: int, floor: int = 1) -> torch.Tensor:
        m = x.shape[0]
        short = floor - (m - (m - 1) // chunk * chunk)
        x2 = torch.cat([x, x.new_zeros(short, x.shape[1])]) if short > 0 else x
        parts = []
        for i in range(0, x2.shape[0], chunk):
            part = x2[i:i + chunk]
            calls.append(len(part))
            parts.append(torch.stack([weight @ r for r in part]) + kind(len(part)))  # (each row alone)
        return torch.cat(parts)[:m]

    rows.calls = calls
    return rows


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    fresh_verdicts(monkeypatch, exact.VERDICT_KIND)


WEIGHT = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind, want", [
    (lambda s: 0.0, LinearChoice(LARGE_CHUNK)),  # one blocking for every count: a prefill in large calls
    (lambda s: float(s > MAX_CHUNK), LinearChoice(MAX_CHUNK)),  # another past 32 rows (as on an AMX Xeon)
    (lambda s: float(s > 64), LinearChoice(MAX_CHUNK)),  # past 64: the probe's large counts find it
    (lambda s: float(s > 1), LinearChoice(LARGE_CHUNK, floor=PADDED_ROWS)),  # a row alone apart, all else one
    (lambda s: {1: 0.0, 2: 1.0, 3: 2.0}.get(s, 3.0), LinearChoice(LARGE_CHUNK, floor=PADDED_ROWS)),  # (the EPYC)
    (lambda s: 0.0 if s == 1 else 1.0 if s <= 50 else 2.0, LinearChoice(PADDED_ROWS, floor=PADDED_ROWS)),
], ids=["invariant", "apart-past-32", "apart-past-64", "alone-apart", "small-counts-apart", "apart-past-50"])
def test_the_choice_follows_where_the_kernel_changes_its_blocking(kind, want):
    rows = fake_rows(WEIGHT, kind)
    assert choose_linear(WEIGHT, None, rows) == want


def test_the_chosen_calls_give_every_row_its_bits_in_any_batch():
    """Under the choice for the EPYC-like kernel every row of any count (a step, a verify, a prefill past the large
    chunk) equals the row alone, and a prefill of 300 rows goes in three calls, not 75."""
    kind = {1: 0.0, 2: 1.0, 3: 2.0}.get
    rows = fake_rows(WEIGHT, lambda s: kind(s, 3.0))
    choice = choose_linear(WEIGHT, None, rows)
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([rows(x[i:i + 1], choice.chunk, choice.floor) for i in range(300)])
    for m in (1, 2, 5, 33, 129, 300):
        assert torch.equal(rows(x[:m], choice.chunk, choice.floor), alone[:m]), m
    rows.calls.clear()
    rows(x, choice.chunk, choice.floor)
    assert rows.calls == [128, 128, 44]


def test_a_kernel_apart_at_every_count_never_takes_larger_calls():
    """A row's bits depend on its place in the call, so no oneDNN call of several rows is invariant, padded or
    not: one row a call, or torch's plan where this machine finds one invariant."""
    rows = fake_rows(WEIGHT, lambda s: torch.arange(s, dtype=torch.float32)[:, None])
    choice = choose_linear(WEIGHT, None, rows)
    assert choice.floor == 1 and (choice.chunk == 1 or choice.plan is not None)


def test_a_choice_is_probed_once_per_shape_and_thread_count():
    rows = fake_rows(WEIGHT, lambda s: 0.0)
    choose_linear(WEIGHT, None, rows)
    probed = len(rows.calls)
    assert probed and choose_linear(WEIGHT, None, rows) == LinearChoice(LARGE_CHUNK)
    assert len(rows.calls) == probed


def timed(one_row: dict[str, float], many_rows: dict[str, float]):
    """``seconds`` for the choice: each kernel's time on one row and on a prefill's rows, as told."""
    return lambda rows, choice, x: (one_row if x.shape[0] == 1 else many_rows)[choice.kernel]


EPYC = {1: 0.0, 2: 1.0, 3: 2.0}.get  # (oneDNN's calls of 1, 2, 3 and more rows: four blockings)


@pytest.mark.parametrize("packed_kind, one_row, many_rows, want", [
    (lambda s: 0.0, {"packed": 1.0, "onednn": 2.0}, {"packed": 10.0, "onednn": 10.0},
     LinearChoice(LARGE_CHUNK, kernel="packed")),  # invariant and faster on a step's row
    (lambda s: 0.0, {"packed": 1.1, "onednn": 1.0}, {"packed": 11.0, "onednn": 10.0},
     LinearChoice(LARGE_CHUNK, kernel="packed")),  # a near tie: the packed kernel (load cannot flip the choice)
    (lambda s: 0.0, {"packed": 2.0, "onednn": 1.0}, {"packed": 5.0, "onednn": 10.0},
     LinearChoice(LARGE_CHUNK, floor=PADDED_ROWS)),  # slower on a step's row: a prefill's speed does not buy it
    (lambda s: 0.0, {"packed": 1.0, "onednn": 2.0}, {"packed": 30.0, "onednn": 10.0},
     LinearChoice(LARGE_CHUNK, floor=PADDED_ROWS)),  # 3x slower on a prefill's rows (as a 8960-wide weight here)
    (lambda s: float(s > 4), {"packed": 1.0, "onednn": 2.0}, {"packed": 10.0, "onednn": 10.0},
     LinearChoice(LARGE_CHUNK, floor=PADDED_ROWS)),  # another blocking past 4 rows: never chosen, however fast
], ids=["packed-faster", "packed-near-tie", "packed-slower-alone", "packed-slow-prefill", "packed-not-invariant"])
def test_the_packed_kernel_is_chosen_where_it_is_invariant_and_not_clearly_slower(packed_kind, one_row, many_rows, want):
    rows = fake_rows(WEIGHT, lambda s: EPYC(s, 3.0))
    packed = fake_rows(WEIGHT, packed_kind)
    assert choose_linear(WEIGHT, None, rows, packed, timed(one_row, many_rows)) == want


def test_the_packed_kernel_stands_in_where_onednn_refuses_the_dtype():
    def refuses(x, chunk, floor=1):
        raise RuntimeError("oneDNN: unsupported data type")

    packed = fake_rows(WEIGHT, lambda s: 0.0)
    never = timed({}, {})  # (no timing: oneDNN has no calls to time)
    assert choose_linear(WEIGHT, None, refuses, packed, never) == LinearChoice(LARGE_CHUNK, kernel="packed")


def test_a_remembered_choice_is_one_the_probe_can_make():
    good = {"chunk": LARGE_CHUNK, "floor": 1, "plan": None, "kernel": "packed"}
    assert exact._read_choice(good) == LinearChoice(LARGE_CHUNK, kernel="packed")
    for bad in ({**good, "floor": PADDED_ROWS}, {**good, "chunk": 4}, {**good, "kernel": "mystery"},
                {**good, "kernel": "onednn", "chunk": LARGE_CHUNK + 1}):
        with pytest.raises(ValueError, match="no such choice"):
            exact._read_choice(bad)
    with pytest.raises(KeyError):
        exact._read_choice({"chunk": LARGE_CHUNK, "floor": 1, "plan": None})  # (an older file's: measured again)


def test_an_engines_mode_comes_from_its_config_and_a_bad_one_is_refused():
    """Exact mode is an engine's setting, passed in its config (``additional_config``), never the environment's."""
    from types import SimpleNamespace

    from rag_accel.vllm.requests import exact_config

    def config(value):
        return SimpleNamespace(additional_config=exact_config(value, {"other": 1}))

    assert [exact.mode(config(v)) for v in ("auto", "on", "off")] == ["auto", "on", "off"]
    assert exact.mode(None) == exact.mode(SimpleNamespace(additional_config={})) == "off"
    with pytest.raises(ValueError, match="rag_accel_exact"):
        exact.mode(SimpleNamespace(additional_config={"rag_accel_exact": "yes"}))
    assert [exact.active(m, torch.bfloat16) for m in ("auto", "on", "off")] == [True, True, False]
    assert [exact.active(m, torch.float32) for m in ("auto", "on", "off")] == [False, True, False]
    with pytest.raises(ValueError, match="exact switch"):
        exact_config("on", {"rag_accel_exact": "off"})  # (one owner: the exact argument)
