"""The vLLM backend: RagProposer inside a real vLLM engine (CPU, float32, SmolLM2-135M-Instruct).

Exactness: greedy outputs with our proposer equal vLLM's own greedy outputs with speculation
off, token for token, whatever the references (right, wrong, another question's), at batch 1
and with 8 concurrent requests. One engine per kind, shared by the module (a start takes
1-2 minutes on a busy 2-core machine; the speculation-off one is the run's, tests/conftest.py,
which tests/test_serve.py compares with too). Unit tests of the pieces run without an engine.

Without vLLM installed the module is skipped, unless RAG_ACCEL_REQUIRE_VLLM=1 (CI), where
that is an error.
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()

import numpy as np  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages  # noqa: E402
from rag_accel.vllm import (  # noqa: E402
    BatchStepCosts,
    RagProposer,
    RowTracker,
    VllmDecoder,
    check_extra_args,
)
from rag_accel.vllm.requests import SETTINGS_ENV, ServerSettings  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")

MODEL = "smollm2-135m-instruct"
N_ITEMS = 5
MAX_NEW = 40
K = 10  # max_draft_tokens of the engines (vLLM's num_speculative_tokens)
ENGINE = dict(max_model_len=2048, enforce_eager=True)


# --------------------------------------------------------------------------- pieces, no engine
def test_check_extra_args_refuses_garbage():
    check_extra_args(None)
    check_extra_args({"references": ["a", [1, 2]], "speculate": False, "rag_accel": {"max_loss": 0.1},
                      "someone_elses_key": object()})
    bad = [
        ({"references": 5}, "references"),
        ({"references": [3.5]}, r"references'\]\[0\]"),
        ({"references": [[1, "x"]]}, r"references'\]\[0\]"),
        ({"references": [[-1]]}, "negative"),
        ({"speculate": "yes"}, "speculate"),
        ({"rag_accel": {"bogus": 1}}, "bogus"),
        ({"rag_accel": {"max_loss": -1}}, "max_loss"),
        ({"rag_accel": {"drafters": ["draft_model"]}}, "draft model"),
        ("not a dict", "dict"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            check_extra_args(args)


def test_step_costs_learn_the_slope_and_back_off_when_busy():
    costs = BatchStepCosts()
    for _ in range(200):  # a step costs 10 ms + 1 ms per scheduled token
        for tokens in (1, 5, 11, 2):
            costs.observe(tokens, 0.010 + 0.001 * tokens)
    a, b = costs.line()
    assert a == pytest.approx(0.010, rel=0.05) and b == pytest.approx(0.001, rel=0.05)
    costs.set_batch(1, 1)
    alone = costs.slope
    costs.set_batch(16, 16)
    busy = costs.slope
    assert alone == pytest.approx(0.001 / 0.011, rel=0.05)
    assert busy > 5 * alone  # one row's drafts slow 16 rows: each draft token costs far more


def test_step_costs_noise_never_makes_drafts_free():
    """The defect behind '171 drafted, 17 accepted': on a loaded machine the step times varied
    more than draft tokens changed them, the fit found b = 0, and every draft cost ~0: the
    policy then sent 10-token prompt-lookup drafts at 8% acceptance. The slope now stays
    within the prior's reach (here: noise of +-50% and no slope visible at all)."""
    rng = np.random.default_rng(0)
    costs = BatchStepCosts()
    for _ in range(300):
        tokens = int(rng.integers(1, 12))
        costs.observe(tokens, 0.1 * (1.0 + rng.uniform(-0.5, 0.5)))  # no visible slope, only noise
    costs.set_batch(1, 1)
    assert costs.slope >= 0.5 * costs.prior_slope * 0.9
    # the policy's curve: 1 + CURVE_SLOPE * L scaled by slope / CURVE_SLOPE = 1 + slope * L
    assert costs.batch_scale * BatchStepCosts.CURVE_SLOPE == pytest.approx(costs.slope)


def test_step_costs_floor_gives_way_where_the_data_place_the_slope_below_it():
    """A GPU: a step costs 10 ms and each scheduled token 0.01 ms more (b / a = 0.001, a twentieth of
    this CPU's), 5% noise. The CPU-measured floor (half the prior: 0.015) would price a draft token
    15x its cost; after enough steps the long window's upper confidence bound replaces it, and it
    stays above what the data say (never below the true slope here). With the bound off the floor
    holds (``floor_z=None``: the behaviour before), and with noise alone it holds too (the test above)."""
    def run(costs, steps):
        rng = np.random.default_rng(2)
        for _ in range(steps):
            tokens = int(rng.integers(1, 12))
            costs.observe(tokens, (0.010 + 0.00001 * tokens) * (1.0 + rng.normal(0.0, 0.05)))
        costs.set_batch(1, 1)
        return costs.slope

    floor = 0.5 * BatchStepCosts().prior_slope
    assert run(BatchStepCosts(floor_z=None), 2000) >= 0.9 * floor
    few, many = BatchStepCosts(), BatchStepCosts()
    assert run(few, 60) >= 0.9 * floor  # ~60 steps: too little data to lower the floor
    assert few.slope_bound() is None
    assert 0.001 <= run(many, 2000) < 0.4 * floor
    assert 0.00001 <= many.slope_bound() < 0.4 * floor * 0.010  # seconds per token: above the true 0.01 ms


@pytest.mark.parametrize("load", ["noise", "bursts"])
def test_step_costs_floor_holds_on_a_loaded_cpu(load):
    """This CPU's slope (0.03) for 3,000 steps under +-50% noise, or under load that comes in bursts
    (steps twice as slow, 50 at a time, 30% of the time): the floor never gives way, since the data
    show the slope itself."""
    def check(costs):
        assert costs.slope_floor() == pytest.approx(costs.min_slope_frac * costs.generic_prior_b())
        bound = costs.slope_bound()
        assert bound is None or bound >= 0.1 * 0.03  # an upper bound: never below the true slope

    rng = np.random.default_rng(3)
    costs = BatchStepCosts()
    burst = 1.0
    for i in range(3000):
        tokens = int(rng.integers(1, 12))
        if load == "noise":
            costs.observe(tokens, 0.1 * (1.0 + 0.03 * tokens) * (1.0 + rng.uniform(-0.5, 0.5)))
            if i % 100 == 99:
                check(costs)
            continue
        if i % 50 == 0:
            burst = 2.0 if rng.random() < 0.3 else 1.0
        costs.observe(tokens, 0.1 * (1.0 + 0.03 * tokens) * burst * (1.0 + rng.normal(0.0, 0.15)))
        if i % 100 == 99:
            check(costs)
    check(costs)


def test_step_costs_remember_a_busy_batch_after_it_stops_drafting():
    """Sixteen compute-bound rows: every scheduled token costs its share (t = 20 ms x T). While
    drafts vary T the slope is learnt; when the rows stop drafting (T = 16 for hundreds of
    steps) the cost must stay what was learnt, not drift back to the cheap prior (which made
    the rows draft again and lose: the cycle behind -3.3% at 16 in flight)."""
    costs = BatchStepCosts()
    rng = np.random.default_rng(1)
    for _ in range(150):
        tokens = 16 + int(rng.integers(0, 25))
        costs.observe(tokens, 0.020 * tokens)
    costs.set_batch(16, 16)
    learnt = costs.slope
    assert learnt == pytest.approx(1.0, rel=0.1)  # 16 rows x 20 ms / 320 ms: a draft token costs a step
    for _ in range(400):
        costs.observe(16, 0.020 * 16)
    costs.set_batch(16, 16)
    assert costs.slope == pytest.approx(learnt, rel=0.1)
    fresh = BatchStepCosts()  # without that memory: the prior's cheap drafts
    for _ in range(400):
        fresh.observe(16, 0.020 * 16)
    fresh.set_batch(16, 16)
    assert fresh.slope < 0.5 * learnt


def _fake_config(k=4, vocab=100):
    mc = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: vocab, tokenizer="unused")
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k), model_config=mc)


def test_rows_follow_batch_updates_and_draft_from_their_own_references():
    """Two requests with different references; rows swap and one leaves: each keeps its drafters."""
    proposer = RagProposer(_fake_config())
    tracker = RowTracker(_fake_config())
    proposer.tracker = tracker
    a = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[5, 6, 7, 8, 9, 10]]})
    b = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[50, 51, 52, 53, 54, 55]]})
    c = SamplingParams(temperature=0, max_tokens=20, extra_args={"speculate": False})
    tokens = np.zeros((3, 64), dtype=np.int64)
    tokens[0, :3] = [1, 5, 6]  # prompt [1, 5], first token 6
    tokens[1, :3] = [2, 50, 51]
    tokens[2, :3] = [3, 5, 6]
    tracker.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                     added=[(0, a, [1, 5], []), (1, b, [2, 50], []), (2, c, [3, 5], [])]))
    drafts = proposer.propose([[6], [51], [6]], np.array([3, 3, 3]), tokens)
    assert drafts[0][:2] == [7, 8] and drafts[1][:2] == [52, 53] and drafts[2] == []
    # Rows 0 and 1 swap; the runner swapped their token rows too. Both accepted their drafts.
    tracker.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    tokens[[0, 1]] = tokens[[1, 0]]
    n0, n1 = len(drafts[1]), len(drafts[0])
    new0, new1 = [52, 53, 54, 55][:n0] + [99], [7, 8, 9, 10][:n1] + [99]
    tokens[0, 3:3 + len(new0)], tokens[1, 3:3 + len(new1)] = new0, new1
    tokens[2, 3] = 7
    drafts2 = proposer.propose([new0, new1, [7]], np.array([3 + len(new0), 3 + len(new1), 4]), tokens)
    assert all(t < 100 for d in drafts2 for t in d)
    assert tracker.rows[0].stats.accepted == n0 and tracker.rows[1].stats.accepted == n1
    assert tracker.rows[2].stats.drafted == 0
    # Row 0 leaves; row 2 moves into it.
    tracker.update_state(BatchUpdate(batch_size=2, removed=[0], added=[],
                                     moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert set(tracker.rows) == {0, 1} and not tracker.rows[0].speculate


def test_a_bad_row_never_stops_the_others(monkeypatch):
    """Off-vocabulary reference ids: refused at admission where the server knows the vocabulary
    (rag-accel serve's settings carry its vocab_size: HTTP 400); a row that reaches the worker anyway
    is not drafted, and the others are."""
    proposer = RagProposer(_fake_config(vocab=100))
    tracker = RowTracker(_fake_config())
    proposer.tracker = tracker
    bad = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[5, 6, 10**6]]})  # off-vocab
    good = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[5, 6, 7, 8]]})
    monkeypatch.setenv(*ServerSettings(vocab_size=100).environment().popitem())
    with pytest.raises(ValueError, match="token id 1000000, outside the model's vocabulary"):
        RowTracker.validate_params(bad)
    RowTracker.validate_params(good)
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[0, :3] = tokens[1, :3] = [1, 5, 6]
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                     added=[(0, bad, [1, 5], []), (1, good, [1, 5], [])]))
    drafts = proposer.propose([[6], [6]], np.array([3, 3]), tokens)
    assert drafts[0] == [] and 0 not in tracker.rows
    assert drafts[1][:2] == [7, 8]


def test_a_finished_answer_drafts_for_later_requests_of_its_scope_only(monkeypatch):
    """A row's output joins its memory scope when it leaves the batch (here: replaced in its slot, which
    vLLM reports as an addition, not a removal); a later row of that scope drafts from it, a row of
    another scope or of none does not (issue 29)."""
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    proposer = RagProposer(_fake_config())
    proposer.tracker = tracker = RowTracker(_fake_config())

    def params(**extra):
        return SamplingParams(temperature=0, max_tokens=20, extra_args=extra)

    tokens = np.zeros((3, 64), dtype=np.int64)
    answer = [6, 20, 21, 22, 23, 24]
    tokens[0, :2 + len(answer)] = [1, 5, *answer]  # prompt [1, 5]
    tracker.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                     added=[(0, params(memory_scope="t1"), [1, 5], [])]))
    for n in range(3, 3 + len(answer)):  # plain steps: one token each
        proposer.propose([[int(tokens[0, n - 1])]], np.array([n]), tokens)
    assert tracker.finished == [] and proposer.memory.scopes() == []
    later = [(0, params(memory_scope="t1"), [6, 20], []), (1, params(memory_scope="t2"), [6, 20], []),
             (2, params(), [6, 20], [])]
    tracker.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=later))  # row 0 replaced
    tokens[:, :3] = [6, 20, 21]  # each: prompt [6, 20], first token 21
    drafts = proposer.propose([[21], [21], [21]], np.array([3, 3, 3]), tokens)
    assert proposer.memory.scopes() == ["t1"]
    assert drafts[0][:3] == [22, 23, 24] and tracker.rows[0].drafting.chain.drafters[0].name == "memory"
    assert drafts[1] == [] and drafts[2] == []  # another tenant's answer, or no scope: nothing from it
    assert all(d.name != "memory" for i in (1, 2) for d in tracker.rows[i].drafting.chain.drafters)
    proposer.reset_learning()  # a fresh engine remembers nothing
    assert proposer.memory.scopes() == []


class _SlowTokenizer:
    """Splits on spaces into ids; waits for a signal first, as a big reference's tokenising would take time."""

    def __init__(self):
        import threading

        self.go = threading.Event()

    def __call__(self, text, add_special_tokens=False):
        assert self.go.wait(10)
        return {"input_ids": [int(w) for w in text.split()]}


def test_large_text_references_are_indexed_off_the_step_loop():
    """Text references over WAITED_REFERENCE_SIZE characters are tokenised and indexed on a background
    thread: the row's steps go on (drafting from its prompt) while they are, and their reference drafts
    start once they are ready."""
    from rag_accel.references import WAITED_REFERENCE_SIZE

    proposer = RagProposer(_fake_config(vocab=100))
    proposer.tracker = tracker = RowTracker(_fake_config())
    proposer._tokenizer = tok = _SlowTokenizer()
    big = "9 5 6 40 41 42 43 44" + " 1" * (WAITED_REFERENCE_SIZE // 2)
    params = SamplingParams(temperature=0, max_tokens=30, extra_args={"references": [big]})
    tokens = np.zeros((1, 64), dtype=np.int64)
    tokens[0, :4] = [3, 5, 6, 3]  # prompt [3, 5, 6], first token 3
    tracker.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params, [3, 5, 6], [])]))
    first = proposer.propose([[3]], np.array([4]), tokens)  # returns while the tokenizer waits
    row = tracker.rows[0]
    assert row.pending is not None and not row.pending.done
    assert first[0][:2] == [5, 6]  # prompt lookup: "3" was followed by "5 6" in the prompt
    tok.go.set()
    assert row.pending.wait(10)
    n = 4
    new = first[0][:2] + [40]  # the model accepted "5 6" (the prompt lookup), then said "40" itself
    tokens[0, n:n + 3] = new
    drafts = proposer.propose([new], np.array([n + 3]), tokens)
    assert row.pending is None and [d.name for d in row.drafting.chain.drafters][0] == "reference"
    assert drafts[0][:3] == [41, 42, 43]  # the reference's "5 6 40" continues "41 42 43"


def test_small_text_references_draft_from_the_first_step():
    """A prediction's few hundred characters are tokenised in the step that starts the row (the tokenizer is
    loaded at engine start): its first draft copies them, whatever else the machine is doing. (Indexed on the
    background thread, a short answer on a busy server could end before they were ready: issue 54's CI.)"""
    proposer = RagProposer(_fake_config(vocab=100))
    proposer.tracker = tracker = RowTracker(_fake_config())
    tok = _SlowTokenizer()
    tok.go.set()
    proposer._tokenizer = tok
    params = SamplingParams(temperature=0, max_tokens=30, extra_args={"references": ["5 6 3 40 41 42 43 44"]})
    tokens = np.zeros((1, 64), dtype=np.int64)
    tokens[0, :4] = [3, 5, 6, 3]  # prompt [3, 5, 6], first token 3
    tracker.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, params, [3, 5, 6], [])]))
    first = proposer.propose([[3]], np.array([4]), tokens)
    row = tracker.rows[0]
    assert row.pending is None and [d.name for d in row.drafting.chain.drafters][0] == "reference"
    assert first[0][:3] == [40, 41, 42]  # the reference's "5 6 3" continues "40 41 42", not the prompt's "5 6"


# --------------------------------------------------------------------------- real engines
def _shutdown(dec):
    dec.close()
    del dec
    gc.collect()


@pytest.fixture(scope="module")
def items():
    items = load_msmarco_sample(limit=N_ITEMS + 8)
    return items


@pytest.fixture(scope="module")
def baseline(items, vllm_greedy):
    """vLLM's own greedy outputs, speculation off (the run's engine without a speculative config,
    tests/conftest.py, the same ENGINE settings): each item alone (batch 1), and the 8 concurrent
    requests of the batch test."""
    dec = vllm_greedy
    assert dec.context_window == ENGINE["max_model_len"]
    alone = [dec.generate(rag_messages(it.query, it.passages), max_new_tokens=MAX_NEW).token_ids
             for it in items[:N_ITEMS]]
    batch = [o.token_ids for o in dec.generate_batch([rag_messages(it.query, it.passages) for it in items[:8]],
                                                     max_new_tokens=MAX_NEW)]
    texts = [dec.tokenizer.decode(ids, skip_special_tokens=True) for ids in alone]
    return SimpleNamespace(alone=alone, batch=batch, texts=texts, plain=dec)


@pytest.fixture(scope="module")
def dec(baseline):
    d = VllmDecoder.from_pretrained(MODEL, max_draft_tokens=K, disable_log_stats=False, **ENGINE)
    yield d
    _shutdown(d)


def _references(kind, i, items, baseline):
    it = items[i]
    if kind == "passages":
        return it.passages
    if kind == "right":  # the greedy answer itself: every draft is right
        return [baseline.texts[i]]
    if kind == "wrong":  # fluent text that is never the answer
        return ["The quick brown fox jumps over the lazy dog. " * 8]
    if kind == "other":  # another question's passages
        return items[(i + 1) % N_ITEMS + N_ITEMS].passages
    raise ValueError(kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["passages", "right", "wrong", "other"])
def test_greedy_equals_vllm_without_speculation_batch1(dec, items, baseline, kind):
    for i, it in enumerate(items[:N_ITEMS]):
        out = dec.generate(rag_messages(it.query, it.passages), _references(kind, i, items, baseline),
                           max_new_tokens=MAX_NEW)
        assert out.token_ids == baseline.alone[i], f"item {i} ({kind} references) differs from vLLM greedy"
        assert out.stats.new_tokens == len(out.token_ids)
        if kind == "right":  # always-right references: their drafts kept, few steps
            st, ref = out.stats, out.stats.by_drafter["reference"]
            # (prompt lookup may draft before the reference has matched enough context)
            assert ref["accepted"] >= 0.9 * ref["drafted"] > 0 and st.steps <= st.new_tokens / 2, st


def _spec_counters(llm):
    """vLLM's own spec-decode counters: (draft tokens, accepted tokens)."""
    found = {m.name: m.value for m in llm.get_metrics() if m.name in (
        "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
    return found.get("vllm:spec_decode_num_draft_tokens", 0), found.get("vllm:spec_decode_num_accepted_tokens", 0)


@pytest.mark.slow
def test_our_counts_are_vllms_counts(dec, items, baseline):
    """What the proposer counts as drafted / accepted is what vLLM's scheduler verified
    (its spec-decode metrics): no draft trimmed, no accepted token missed."""
    it = items[1]
    d0, a0 = _spec_counters(dec.llm)
    out = dec.generate(rag_messages(it.query, it.passages), [baseline.texts[1]], max_new_tokens=MAX_NEW)
    d1, a1 = _spec_counters(dec.llm)
    assert out.token_ids == baseline.alone[1]
    assert (out.stats.drafted, out.stats.accepted) == (d1 - d0, a1 - a0)
    ref = out.stats.by_drafter["reference"]
    assert ref["accepted"] >= 0.9 * ref["drafted"] > 0


@pytest.mark.slow
def test_vllm_ngram_engine_equals_greedy_and_counts_its_steps(items, baseline):
    """The benchmark's peer, vLLM's own n-gram speculation, through the same decoder: outputs
    equal vLLM greedy, and ``steps`` counts the engine steps that gave the request tokens
    (the answers copy from the passages in the prompt, so some steps bring several tokens;
    with speculation off every step brings one)."""
    plain = baseline.plain.generate(rag_messages(items[0].query, items[0].passages), max_new_tokens=MAX_NEW)
    assert plain.stats.steps == plain.stats.new_tokens == len(baseline.alone[0])
    ngram = VllmDecoder.from_pretrained(MODEL, speculation="ngram", max_draft_tokens=K, **ENGINE)
    try:
        outs = [ngram.generate(rag_messages(it.query, it.passages), max_new_tokens=MAX_NEW) for it in items[:3]]
    finally:
        _shutdown(ngram)
    assert [o.token_ids for o in outs] == baseline.alone[:3]
    assert all(0 < o.stats.steps <= o.stats.new_tokens for o in outs)
    assert sum(o.stats.steps for o in outs) < sum(o.stats.new_tokens for o in outs)
    assert all(o.stats.drafted == o.stats.accepted == 0 for o in outs)  # vLLM's drafts are not ours to count


@pytest.mark.slow
def test_vllm_suffix_engine_equals_greedy_or_says_what_to_install(items, baseline):
    """The benchmark's other peer, vLLM's suffix decoding: it needs arctic-inference (not in CI's
    virtualenv: it builds from source). Without it the decoder refuses before starting an engine,
    saying what to install; with it (the benchmark machine) outputs equal vLLM greedy."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(ImportError, match="pip install arctic-inference"):
            VllmDecoder.from_pretrained(MODEL, speculation="suffix", max_draft_tokens=K, **ENGINE)
        return
    suffix = VllmDecoder.from_pretrained(MODEL, speculation="suffix", max_draft_tokens=K, **ENGINE)
    try:
        assert suffix.speculation == "suffix"
        outs = [suffix.generate(rag_messages(it.query, it.passages), max_new_tokens=MAX_NEW) for it in items[:3]]
    finally:
        _shutdown(suffix)
    assert [o.token_ids for o in outs] == baseline.alone[:3]
    assert sum(o.stats.steps for o in outs) < sum(o.stats.new_tokens for o in outs)


@pytest.mark.slow
def test_eight_concurrent_requests_with_different_references(dec, items, baseline):
    kinds = ["passages", "right", "wrong", "other", "passages", "right", "wrong", "other"]
    prompts = [rag_messages(it.query, it.passages) for it in items[:8]]
    refs = [_references(k, i % N_ITEMS, items, baseline) if k not in ("passages",) or i < N_ITEMS
            else items[i].passages for i, k in enumerate(kinds)]
    outs = dec.generate_batch(prompts, refs, max_new_tokens=MAX_NEW)
    for i, out in enumerate(outs):
        assert out.token_ids == baseline.batch[i], f"request {i} ({kinds[i]}) differs from vLLM greedy"
    assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.slow
def test_calls_from_threads_share_the_batch(dec, items, baseline):
    """Eight threads call ``generate`` at once, each with its own references: they run together in
    vLLM's batch (no lock held across a call), and each output is vLLM's greedy output.

    The reference outputs are the 8 requests of one ``generate_batch`` with speculation off and
    the items alone: on this engine both are the same (asserted), so the arrival order of the
    threads cannot change an exact comparison."""
    from concurrent.futures import ThreadPoolExecutor

    assert baseline.batch[:N_ITEMS] == baseline.alone  # vLLM's CPU greedy does not depend on the batch here
    kinds = ["passages", "right", "wrong", "other", "passages", "right", "wrong", "other"]
    refs = [_references(k, i % N_ITEMS, items, baseline) for i, k in enumerate(kinds)]
    prompts = [rag_messages(it.query, it.passages) for it in items[:8]]
    most = [0]
    real_step = dec.llm.llm_engine.step

    def counting_step():
        outs = real_step()
        most[0] = max(most[0], dec.llm.llm_engine.get_num_unfinished_requests())
        return outs

    dec.llm.llm_engine.step = counting_step
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: dec.generate(prompts[i], refs[i], max_new_tokens=MAX_NEW), range(8)))
    finally:
        del dec.llm.llm_engine.step
    for i, out in enumerate(outs):
        assert out.token_ids == baseline.batch[i], f"thread {i} ({kinds[i]}) differs from vLLM greedy"
    assert most[0] >= 4, f"at most {most[0]} requests were in the engine together: calls did not overlap"
    assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.slow
def test_a_paused_stream_blocks_nobody_and_a_closed_one_leaves_nothing(dec, items, baseline):
    msgs = [rag_messages(it.query, it.passages) for it in items[:2]]
    stream = dec.stream(msgs[0], items[0].passages, max_new_tokens=MAX_NEW)
    it = iter(stream)
    first = next(it)  # the stream's request is in the engine now; nobody reads it for a while
    import threading

    other: list = []
    t = threading.Thread(target=lambda: other.append(dec.generate(msgs[1], items[1].passages,
                                                                  max_new_tokens=MAX_NEW)))
    t.start()
    t.join(timeout=300)
    assert not t.is_alive() and other[0].token_ids == baseline.alone[1]
    assert first + "".join(it) == stream.output.text and stream.output.token_ids == baseline.alone[0]
    half = dec.stream(msgs[0], items[0].passages, max_new_tokens=MAX_NEW)
    next(iter(half))
    half.close()  # dropped half-read: its request is aborted, nothing waits for it
    assert dec.llm.llm_engine.get_num_unfinished_requests() == 0
    assert dec.generate(msgs[1], items[1].passages, max_new_tokens=MAX_NEW).token_ids == baseline.alone[1]


@pytest.mark.slow
def test_speculate_false_drafts_nothing_and_right_references_draft(dec, items, baseline):
    it = items[0]
    off = dec.generate(rag_messages(it.query, it.passages), [baseline.texts[0]], max_new_tokens=MAX_NEW,
                       speculate=False)
    on = dec.generate(rag_messages(it.query, it.passages), [baseline.texts[0]], max_new_tokens=MAX_NEW)
    assert off.token_ids == on.token_ids == baseline.alone[0]
    assert off.stats.drafted == 0 and off.stats.by_drafter == {}
    assert on.stats.drafted > 0 and on.stats.accepted > 0
    assert sum(n for _, n in on.stats.trace) >= on.stats.new_tokens


def test_answers_draft_as_the_memory_in_their_own_row():
    """A request's answers (a cached answer) draft under the memory's name, in that row only; its
    references still draft as references."""
    proposer = RagProposer(_fake_config())
    tracker = RowTracker(_fake_config())
    proposer.tracker = tracker
    a = SamplingParams(temperature=0, max_tokens=20, extra_args={"answers": [[5, 6, 7, 8, 9, 10]]})
    b = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[50, 51, 52, 53]],
                                                                  "answer_ids": "[[70, 71, 72, 73]]"})
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[0, :3] = [1, 5, 6]
    tokens[1, :3] = [2, 50, 51]
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                     added=[(0, a, [1, 5], []), (1, b, [2, 50], [])]))
    drafts = proposer.propose([[6], [51]], np.array([3, 3]), tokens)
    assert drafts[0][:2] == [7, 8] and tracker.rows[0].source == "memory"
    assert drafts[1][:2] == [52, 53] and tracker.rows[1].source == "reference"
    assert [d.name for d in tracker.rows[1].drafting.chain.drafters][:2] == ["reference", "memory"]


@pytest.mark.slow
def test_a_cached_answer_passed_as_answers_drafts_as_the_memory_and_stays_exact(dec, items, baseline):
    """The greedy answer passed as ``answers=`` (no references, no memory scope): drafted by the memory's
    drafter, the output still vLLM greedy's; generate_batch takes one answers entry per prompt."""
    msgs = [rag_messages(it.query, it.passages) for it in items[:2]]
    out = dec.generate(msgs[0], answers=[baseline.texts[0]], max_new_tokens=MAX_NEW)
    assert out.token_ids == baseline.alone[0]
    mem = out.stats.by_drafter["memory"]
    assert mem["accepted"] >= 0.8 * mem["drafted"] > 0 and "reference" not in out.stats.by_drafter, out.stats
    outs = dec.generate_batch(msgs, answers=[None, [baseline.texts[1]]], max_new_tokens=MAX_NEW)
    assert [o.token_ids for o in outs] == baseline.alone[:2]
    assert "memory" not in outs[0].stats.by_drafter and outs[1].stats.by_drafter["memory"]["accepted"] > 0
    with pytest.raises(ValueError, match="one entry per prompt"):
        dec.generate_batch(msgs, answers=[baseline.texts[1]])
    with pytest.raises(ValueError, match="max_reference_tokens=100"):  # references and answers together
        dec.generate(msgs[0], [[7] * 60], answers=[[7] * 60], config={"max_reference_tokens": 100})
    with pytest.raises(TypeError, match="answers must be a list"):
        dec.generate(msgs[0], answers=5)


@pytest.mark.slow
def test_a_prediction_drafts_as_references_exactly_and_is_counted(dec, items, baseline):
    """OpenAI's prediction on VllmDecoder (issue 54): right, wrong and per-prompt in generate_batch, every
    output vLLM greedy's; the counts are the reference drafter's, and vLLM's own counters agree."""
    msgs = [rag_messages(it.query, it.passages) for it in items[:2]]
    right = {"type": "content", "content": [{"type": "text", "text": baseline.texts[0]}]}
    d0, a0 = _spec_counters(dec.llm)
    out = dec.generate(msgs[0], prediction=right, max_new_tokens=MAX_NEW, config={"drafters": ("reference",)})
    d1, a1 = _spec_counters(dec.llm)
    st = out.stats
    assert out.token_ids == baseline.alone[0]
    assert st.accepted_prediction_tokens >= 0.8 * MAX_NEW / 2 and st.rejected_prediction_tokens >= 0
    assert (st.accepted_prediction_tokens, st.accepted_prediction_tokens + st.rejected_prediction_tokens) == (
        a1 - a0, d1 - d0)
    wrong = {"type": "content", "content": "The quick brown fox jumps over the lazy dog. " * 8}
    outs = dec.generate_batch(msgs, prediction=[wrong, {"type": "content", "content": baseline.texts[1]}],
                              max_new_tokens=MAX_NEW)
    assert [o.token_ids for o in outs] == baseline.alone[:2] and outs[1].stats.accepted_prediction_tokens > 0
    with pytest.raises(TypeError, match="prediction must be an object"):
        dec.generate(msgs[0], prediction=baseline.texts[0])


def test_rows_of_one_request_add_up_their_stats():
    """Several rows under one key (n > 1, a /v1/completions call with several prompts, a preempted request
    back in a new row): popped once, their counts added up."""
    proposer = RagProposer(_fake_config())
    tracker = RowTracker(_fake_config())
    proposer.tracker = tracker
    params = SamplingParams(temperature=0, max_tokens=20, extra_args={"references": [[5, 6, 7, 8, 9, 10]],
                                                                      "rag_accel_id": "req-1"})
    tokens = np.zeros((2, 64), dtype=np.int64)
    tokens[:, :3] = [1, 5, 6]
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                     added=[(0, params, [1, 5], []), (1, params, [1, 5], [])]))
    drafts = proposer.propose([[6], [6]], np.array([3, 3]), tokens)
    assert drafts[0][:2] == drafts[1][:2] == [7, 8]
    n = len(drafts[0])
    tokens[:, 3:5] = [7, 8]
    proposer.propose([[7, 8], [7, 8]], np.array([5, 5]), tokens)  # each row: 1 draft token kept, then its own
    (stats,) = proposer.pop_stats(["req-1"])
    assert stats["steps"] == 4 and stats["drafted"] == 2 * n and stats["accepted"] == 2
    assert (stats["accepted_prediction_tokens"], stats["rejected_prediction_tokens"]) == (2, 2 * n - 2)
    assert proposer.pop_stats(["req-1"]) == [None]


@pytest.mark.slow
def test_a_decoder_level_config_reaches_the_workers_rows(dec, items, baseline):
    """Issue 55's dropped setting: a config given to the decoder (not per call) changes the drafting in the
    worker. Reference drafts only, a repetitive prompt and no references: nothing is drafted; the engine's
    default config drafts it with the frequency drafter. Both outputs are vLLM greedy's."""
    from rag_accel import DecoderConfig

    prompt = [{"role": "user", "content": "Repeat after me five times: the cat sat on the mat. " * 3}]
    only_refs = VllmDecoder(dec.llm, DecoderConfig(drafters=("reference",)))
    plain = baseline.plain.generate(prompt, max_new_tokens=MAX_NEW).token_ids
    out = only_refs.generate(prompt, max_new_tokens=MAX_NEW)
    default = dec.generate(prompt, max_new_tokens=MAX_NEW)
    assert out.token_ids == default.token_ids == plain
    assert out.stats.drafted == 0 and out.stats.by_drafter == {}, out.stats
    assert default.stats.by_drafter.get("frequency", {}).get("accepted", 0) > 0, default.stats


def test_rows_start_from_the_workers_base_plus_the_requests_changes():
    from rag_accel import DecoderConfig
    from rag_accel.wire import WORKER_BASE, RequestArgs

    tracker = RowTracker(_fake_config())
    wire = RequestArgs(config=DecoderConfig(drafters=("reference",), max_loss=0.2)).extra_args()
    params = SamplingParams(temperature=0, max_tokens=20, extra_args=wire)
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                     added=[(0, params, [1, 5], []), (1, SamplingParams(max_tokens=5), [1], [])]))
    assert tracker.rows[0].config == WORKER_BASE.replace(drafters=("reference",), max_loss=0.2)
    assert tracker.rows[1].config == WORKER_BASE


@pytest.mark.slow
def test_a_reset_engine_drafts_from_its_first_request(dec, items, baseline):
    """reset_learning reaches the drafting worker (the stats RPC with forget=True); a proposer that
    has learnt nothing still drafts on strong matches (the cold rates) and stays exact."""
    it = items[0]
    dec.reset_learning()
    out = dec.generate(rag_messages(it.query, it.passages), [baseline.texts[0]], max_new_tokens=MAX_NEW)
    assert out.token_ids == baseline.alone[0]
    assert out.stats.by_drafter["reference"]["accepted"] > 0


@pytest.mark.slow
def test_the_engine_remembers_answers_per_scope_and_stays_exact(dec, items, baseline):
    """The same question asked again in a scope, with no references: the first answer drafts for the
    second through the memory; in another scope, or with none, it does not. Outputs are vLLM greedy's."""
    it = items[2]
    msgs = rag_messages(it.query, it.passages)
    scoped = {s: VllmDecoder(dec.llm, dec.config, memory_scope=s) for s in ("t1", "t2")}  # (the same engine)
    first = scoped["t1"].generate(msgs, max_new_tokens=MAX_NEW)
    again = scoped["t1"].generate(msgs, max_new_tokens=MAX_NEW)
    other = scoped["t2"].generate(msgs, max_new_tokens=MAX_NEW)
    unscoped = dec.generate(msgs, max_new_tokens=MAX_NEW)
    assert first.token_ids == again.token_ids == other.token_ids == unscoped.token_ids == baseline.alone[2]
    mem = again.stats.by_drafter["memory"]
    assert mem["accepted"] >= 0.8 * mem["drafted"] > 0 and again.stats.steps < first.stats.steps, again.stats
    assert "memory" not in first.stats.by_drafter and "memory" not in other.stats.by_drafter
    assert "memory" not in unscoped.stats.by_drafter
    with pytest.raises(ValueError, match="memory_scope"):
        VllmDecoder(dec.llm, dec.config, memory_scope="")


@pytest.mark.slow
def test_stream_stops_and_prompt_forms(dec, items, baseline):
    it = items[0]
    msgs = rag_messages(it.query, it.passages)
    full = dec.generate(msgs, it.passages, max_new_tokens=MAX_NEW)
    stream = dec.stream(msgs, it.passages, max_new_tokens=MAX_NEW)
    assert "".join(stream) == full.text and stream.output.token_ids == full.token_ids
    ids = dec.encode_prompt(msgs)
    assert dec.generate(ids, it.passages, max_new_tokens=MAX_NEW).token_ids == full.token_ids
    word = full.text.split()[3]
    cut = dec.generate(msgs, it.passages, max_new_tokens=MAX_NEW, stop=word)
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(word)]
    assert full.finish_reason in ("eos", "length")
    text = dec.generate("The capital of France is", max_new_tokens=8)
    assert text.stats.new_tokens == len(text.token_ids) > 0


@pytest.mark.slow
def test_bad_requests_are_refused_and_the_engine_keeps_serving(dec, items, baseline):
    llm = dec.llm
    msgs = rag_messages(items[0].query, items[0].passages)
    ids = dec.encode_prompt(msgs)
    for extra in ({"references": 5}, {"references": [[1, "a"]]}, {"speculate": "yes"},
                  {"rag_accel": {"bogus": True}}, {"rag_accel": "garbage"}):
        with pytest.raises(VLLMValidationError, match="extra_args"):  # refused at admission (validate_params)
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4, extra_args=extra),
                         use_tqdm=False)
    with pytest.raises((ValueError, VLLMValidationError)):  # over-long prompt, refused by vLLM at admission
        llm.generate([{"prompt_token_ids": [1] * 3000}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    # Through the decoder: refused before anything reaches the engine.
    with pytest.raises(TypeError, match="reference 0"):
        dec.generate(msgs, [3.5], max_new_tokens=4)
    with pytest.raises(ValueError, match="context window"):
        dec.generate([1] * 2040, max_new_tokens=40)
    with pytest.raises(ValueError, match="bogus|keys"):
        dec.generate(msgs, max_new_tokens=4, config={"bogus": 1})
    # Off-vocabulary reference ids pass admission (no vocabulary there): that request drafts
    # nothing, the engine and the request go on, exactly.
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=MAX_NEW, extra_args={"references": [[10**7, 5]]}),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == baseline.alone[0]
    assert dec.generate(msgs, items[0].passages, max_new_tokens=MAX_NEW).token_ids == baseline.alone[0]


@pytest.mark.slow
def test_sampled_requests_run(dec, items):
    it = items[0]
    out = dec.generate(rag_messages(it.query, it.passages), it.passages, max_new_tokens=16, do_sample=True,
                       temperature=0.8, seed=1)
    assert out.stats.new_tokens == len(out.token_ids) > 0


@pytest.mark.slow
def test_agreement_with_transformers_generate(dec, items, baseline, record_property):
    """vLLM's float32 CPU greedy vs transformers' generate(do_sample=False), same prompt ids.

    The two are different kernels, so they may part ways where two logits nearly tie: this
    measures how often they agree in full (5 of 5 items when last run, 2026-11-25) and asserts a
    floor of all but one; where they agree, our proposer's output is that output too (it equals
    vLLM greedy, tested above)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rag_accel.models import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    agree, first_diff = 0, []
    for i, it in enumerate(items[:N_ITEMS]):
        ids = dec.encode_prompt(rag_messages(it.query, it.passages))
        x = torch.tensor([ids])
        with torch.inference_mode():
            hf = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW,
                                top_p=None, top_k=None, temperature=None)[0, len(ids):].tolist()
        if hf == baseline.alone[i]:  # and ours == baseline.alone[i]: test_greedy_equals_vllm_... above
            agree += 1
        else:
            first_diff.append(next((j for j, (a, b) in enumerate(zip(hf, baseline.alone[i])) if a != b),
                                   min(len(hf), len(baseline.alone[i]))))
    record_property("vllm_hf_agreement", f"{agree}/{N_ITEMS}")
    print(f"\nvLLM float32 CPU greedy == transformers generate on {agree}/{N_ITEMS} items; "
          f"first differing token where not: {first_diff}")
    assert agree >= N_ITEMS - 1, f"vLLM and transformers greedy agree on {agree}/{N_ITEMS}; first diffs {first_diff}"


@pytest.mark.slow
def test_gemma3_across_its_sliding_window_is_exact_with_right_wrong_and_mixed_references():
    """Gemma 3 270M (issue 57: sliding-window attention in 15 of 18 layers, a 262k vocabulary, another
    tokenizer), float32: RAG completion prompts of 480 and 600 tokens, 64-token answers crossing the
    512-token window; each request equals the same request with speculation off on the same engine
    (``speculate=False``, as tests/test_vllm_layouts.py; the bench compares against a separate engine)."""
    from helpers import rag_completion_ids

    from rag_accel.models import GEMMA_MODEL

    dec = VllmDecoder.from_pretrained(GEMMA_MODEL, max_draft_tokens=8, max_model_len=1024, enforce_eager=True)
    try:
        vocab = dec.vocab_size
        for ids in rag_completion_ids(dec.tokenizer, (480, 600)):
            off = dec.generate(ids, max_new_tokens=64, speculate=False).token_ids
            assert len(off) == 64 and len(ids) + len(off) > 512
            context = ids + off
            wrong = [context[len(ids) + j - 4:len(ids) + j] + [(t + 1) % vocab for t in off[j:j + 8]]
                     for j in range(0, 64, 2)]  # every step's context tail, then wrong tokens
            mixed = [[t if i % 7 != 3 else (t + 1) % vocab for i, t in enumerate(context)]]
            text = [dec.tokenizer.decode(off)]
            for kind, refs in (("right", [context]), ("wrong", wrong), ("mixed", mixed), ("text", text)):
                on = dec.generate(ids, refs, max_new_tokens=64)
                assert on.token_ids == off, kind
                st = on.stats
                if kind == "right":
                    assert st.accepted >= 0.9 * st.drafted > 0 and st.steps <= 64 / 3, st
                if kind in ("wrong", "mixed"):
                    assert st.drafted > st.accepted, st
    finally:
        _shutdown(dec)


@pytest.mark.slow
def test_qwen_05b_is_exact_with_right_wrong_and_mixed_references(items):
    """Qwen2.5-Coder-0.5B-Instruct (issue 63: the model class users deploy; grouped KV heads, q/k/v biases, an
    untied head, ChatML), float32: two of the sample's chat prompts, 32-token answers; each request equals the
    same request with speculation off on the same engine, with references always right (the answer's context),
    always wrong, mixed, and as text."""
    from rag_accel.models import QWEN_DRAFT_MODEL

    dec = VllmDecoder.from_pretrained(QWEN_DRAFT_MODEL, max_draft_tokens=8, max_model_len=2048,
                                      enforce_eager=True)
    try:
        vocab = dec.vocab_size
        for it in items[:2]:
            ids = dec.encode_prompt(rag_messages(it.query, it.passages))
            off = dec.generate(ids, max_new_tokens=32, speculate=False).token_ids
            context = ids + off
            wrong = [context[len(ids) + j - 4:len(ids) + j] + [(t + 1) % vocab for t in off[j:j + 8]]
                     for j in range(0, len(off), 2)]  # every step's context tail, then wrong tokens
            mixed = [[t if i % 7 != 3 else (t + 1) % vocab for i, t in enumerate(context)]]
            for kind, refs in (("right", [context]), ("wrong", wrong), ("mixed", mixed),
                               ("text", [dec.tokenizer.decode(off)])):
                on = dec.generate(ids, refs, max_new_tokens=32)
                assert on.token_ids == off, (it.id, kind)
                st = on.stats
                if kind == "right" and len(off) > 8:  # every token but each step's own came from a draft (a draft
                    # past the answer's end is rejected: the acceptance rate is no measure of a right reference)
                    assert st.accepted >= len(off) - st.steps and st.steps <= len(off) / 2, st
                if kind in ("wrong", "mixed"):
                    assert st.drafted > st.accepted, st
    finally:
        _shutdown(dec)


@pytest.mark.slow
def test_bench_runs_the_vllm_methods_beside_the_transformers_ones(dec, items, baseline):
    """``rag-accel bench``'s loop with vLLM engines: the same prompt ids for every method,
    vLLM outputs compared with vllm-greedy (and with transformers' greedy), steps from the
    engine; then the throughput loop with 2 requests in flight."""
    from rag_accel.bench.harness import run_benchmark, run_concurrency
    from rag_accel.bench.results import summarize, summarize_concurrency
    from rag_accel.hf.decoder import ReferenceDecoder

    hf = ReferenceDecoder.from_pretrained(MODEL)
    engines = {"vllm-greedy": baseline.plain, "vllm-ours": dec}
    runs = run_benchmark(hf, items[:2], ["greedy", "ours", "vllm-ours"], 24, engines=engines, reworded=1)
    assert {(r.method, r.case) for r in runs} == {(m, c) for m in ("greedy", "ours", "vllm-ours", "vllm-greedy")
                                                  for c in ("rag", "reworded")}
    assert all(r.identical for r in runs)  # each equals its engine's greedy
    by = {(r.method, r.item): r for r in runs}
    for it in items[:2]:
        assert by["vllm-greedy", it.id].steps == by["vllm-greedy", it.id].new_tokens  # one token a step
        assert by["vllm-ours", it.id].steps < by["vllm-ours", it.id].new_tokens  # drafts were accepted
    s = summarize(runs)
    assert s["vllm-ours"]["tokens_per_step"] > 1.0 and "speedup_vs_vllm_greedy_geomean" in s["vllm-ours"]
    assert 0.0 <= s["vllm-ours"]["identical_to_hf_greedy_rate"] <= 1.0
    # vllm-suffix-elsewhere (suffix decoding on an engine that never answered the originals) runs the reworded
    # case only (the plain engine stands in for it: the harness goes by its name)
    runs = run_benchmark(hf, items[:1], ["greedy", "vllm-suffix-elsewhere"], 24, reworded=1, warmup=items[2],
                         engines={"vllm-greedy": baseline.plain, "vllm-suffix-elsewhere": baseline.plain})
    assert {(r.method, r.case) for r in runs if r.method == "vllm-suffix-elsewhere"} == {
        ("vllm-suffix-elsewhere", "reworded")}
    assert {(r.method, r.case) for r in runs if r.method == "greedy"} == {("greedy", "rag"), ("greedy", "reworded")}
    assert all(r.identical for r in runs) and set(summarize(runs, "reworded")) == {
        "greedy", "vllm-greedy", "vllm-suffix-elsewhere"} and "vllm-suffix-elsewhere" not in summarize(runs)
    # vllm-suffix remembers its earlier answers and these items were answered: it sits out (by name;
    # the plain engine stands in for it, so this costs no engine start)
    batch = run_concurrency({**engines, "vllm-suffix": baseline.plain}, hf, items, [2], 24, n_items=4)
    c = summarize_concurrency(batch)
    assert set(c) == {"vllm-greedy@2", "vllm-ours@2"} and c["vllm-ours@2"]["requests"] == 4
    assert c["vllm-ours@2"]["identical_rate"] == 1.0


@pytest.mark.slow
def test_bench_engines_are_built_after_a_spare_that_is_closed(monkeypatch, items, baseline):
    """``rag-accel bench``'s engines (:func:`vllm_engines`): the first engine built in a process
    tends to be slower than identical ones built after it, so a spare plain engine is built first,
    given a request and shut down before the timed ones are built: vllm-greedy is the second engine
    built, and only its engine process stays. Every engine starts in the peers' environment
    (PEER_ENVIRONMENT: numba's workqueue layer, which vLLM's n-gram proposer needs on a CPU not to
    run at ~0.8x greedy). The real engines, watched by a spy."""
    import multiprocessing
    import os

    from rag_accel.bench.harness import vllm_engines
    from rag_accel.methods import PEER_ENVIRONMENT

    built, closed, seen = [], [], []
    real_make, real_close = VllmDecoder.from_pretrained.__func__, VllmDecoder.close
    for name in PEER_ENVIRONMENT:  # unset (and restored afterwards: setenv records the old state)
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)

    def make(cls, *a, **kw):
        built.append(kw["speculation"])
        seen.append({name: os.environ.get(name) for name in PEER_ENVIRONMENT})
        return real_make(cls, *a, **kw)

    def close(self):
        closed.append(len(built))
        real_close(self)

    monkeypatch.setattr(VllmDecoder, "from_pretrained", classmethod(make))
    monkeypatch.setattr(VllmDecoder, "close", close)
    before = len(multiprocessing.active_children())
    engines = vllm_engines(["vllm-greedy"], MODEL, max_draft_tokens=4, max_model_len=2048)
    try:
        assert list(engines) == ["vllm-greedy"] and built == ["off", "off"]
        assert seen == [PEER_ENVIRONMENT, PEER_ENVIRONMENT]  # the spare's start included
        assert closed == [1]  # the spare, before vllm-greedy was built
        assert len(multiprocessing.active_children()) == before + 1
        procs = engines["vllm-greedy"].engine_processes()
        assert len(procs) == 1 and procs[0].is_alive()  # what close waits for
        it = items[0]
        out = engines["vllm-greedy"].generate(rag_messages(it.query, it.passages), max_new_tokens=MAX_NEW)
        assert out.token_ids == baseline.alone[0]
    finally:
        for e in engines.values():
            e.close()
    # close returns once the engine process has exited (vLLM's shutdown SIGKILLs it after 5 s and
    # returns without waiting: under CI's load it was once still listed here)
    assert not procs[0].is_alive() and len(multiprocessing.active_children()) == before


class _Started(Exception):
    """Raised by a fake ``vllm.LLM``: the engine's arguments were what the test needed."""


def test_an_engine_on_a_cpu_gets_a_kv_cache_sized_to_its_model_unless_told(monkeypatch):
    """vLLM's own CPU default reserves most of the machine's memory for the KV cache: VllmDecoder asks for 32,768
    tokens' worth of the model's keys and values (SmolLM2 in bfloat16: 720 MiB), a caller's size or
    VLLM_CPU_KVCACHE_SPACE standing."""
    import vllm

    seen = []

    def fake_llm(**kwargs):
        seen.append(kwargs)
        raise _Started

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for kwargs in ({}, {"kv_cache_memory_bytes": 1 << 30}):
        with pytest.raises(_Started):
            VllmDecoder.from_pretrained("smollm2-135m-instruct", dtype="bfloat16", **kwargs)
    assert [s["kv_cache_memory_bytes"] >> 20 for s in seen] == [720, 1024]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    with pytest.raises(_Started):
        VllmDecoder.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")
    assert "kv_cache_memory_bytes" not in seen[-1]  # (vLLM reads VLLM_CPU_KVCACHE_SPACE itself)
