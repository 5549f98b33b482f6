"""The parts of the benchmarks that a committed result rests on and that can be checked here, without the
machine that timed it: the GPU step-cost benchmark's static step (it must be the model's own forward, or its
timings price something else), and the replays' kit (:mod:`rag_accel_lab.replay`): the interpolation of the
measured step times, the oracle's copies and the length oracle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rag_accel_lab import replay as rp

EXPERIMENTS = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"


def load(name: str):
    """A script of benchmarks/experiments/ as a module (it imports only rag_accel and installed packages)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_step_costs_static_step_is_the_models_forward():
    """The CUDA-graph step written out in torch gives transformers' logits in float32, for a whole sequence and
    for the last tokens over the KV cache it filled itself (rotary positions, grouped-query attention, mask)."""
    pytest.importorskip("transformers")
    errors = load("gpu_step_costs").check(atol=1e-4)
    assert set(errors) == {"whole", "tail"}
    assert max(errors.values()) <= 1e-4


def shape(rows: int, per_row: int, ms: float) -> dict:
    return {"rows": rows, "tokens_per_row": per_row, "tokens": rows * per_row, "ms_median": ms}


def test_table_cost_interpolates_measured_steps():
    table = rp.TableCost([shape(1, 1, 2.0), shape(1, 3, 3.0), shape(1, 5, 3.5),
                          shape(4, 1, 2.4), shape(4, 3, 4.0)])
    assert table(1, 1) == 1.0  # units of a one-row plain step
    assert table(1, 3) == pytest.approx(1.5)
    assert table(1, 2) == pytest.approx(1.25)  # between measured tokens: linear
    assert table(1, 7) == pytest.approx(2.0)  # beyond the last: the last two points' line
    assert table(4, 2) == pytest.approx(1.2)  # below a row count's first point: its plain step
    assert table(4, 8) == pytest.approx(1.6)
    assert table(2, 4) == pytest.approx((2 / 3) * 1.625 + (1 / 3) * 1.2)  # between row counts: linear in rows
    assert table(64, 12) == pytest.approx(2.0)  # beyond the most rows measured: that row count's table
    a, b = table.line(1)
    assert (a, b) == pytest.approx((1.41667 - 3 * 0.1875, 0.1875), abs=1e-4)  # least squares over (1, 3, 5)
    assert table.line(3) == table.line(4)  # the nearest measured row count


def test_line_cost_is_the_modelled_line():
    cost = rp.LineCost(0.03)
    assert cost(1, 1) == pytest.approx(1.03) and cost(16, 40) == pytest.approx(2.2)
    assert cost.line(7) == (1.0, 0.03)


def test_longest_copy_takes_the_best_place_and_stops_where_a_source_does():
    np = pytest.importorskip("numpy")
    source = np.array([7, 1, 2, 3, 7, 1, 2, 9])
    assert rp.longest_copy(source, np.array([5, 7]), [1, 2, 9, 4], 10) == 3  # the second 7, not the first
    assert rp.longest_copy(source, np.array([5, 7]), [1, 2, 9, 4], 2) == 2  # at most k
    assert rp.longest_copy(source, np.array([5, 8]), [1, 2], 10) == 0  # no match
    assert rp.longest_copy(np.array([7, 1, -1, 2]), np.array([7]), [1, 2], 10) == 1  # a separator ends it
    assert rp.longest_copy(np.array([3, 7, 1]), np.array([7]), [1, 2], 10) == 1  # so does the source's end
    two = np.array([4, 7, 1, 2, -1, 3, 7, 1, 9])
    assert rp.longest_copy(two, np.array([3, 7]), [1, 2], 10) == 2  # any 7
    assert rp.longest_copy(two, np.array([3, 7]), [1, 2], 10, min_match=2) == 1  # only the 7 after a 3
    assert rp.longest_copy(two, np.array([7]), [1, 2], 10, min_match=2) == 0  # a context too short to match


def test_copy_ceiling_takes_the_fewest_steps_of_any_copying():
    """Its greedy steps against every schedule of shorter copies (a search over positions), on small random
    answers: the claim that makes it a ceiling. With earlier answers as a source, the same answer asked again is
    copied whole."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    for _ in range(40):
        prompt = rng.integers(0, 4, 8).tolist()
        refs = [rng.integers(0, 4, 6).tolist(), rng.integers(0, 4, 5).tolist()]
        target = rng.integers(0, 4, 20).tolist()
        prepared = [("a", prompt, refs, target)]
        for min_match in (1, 2):
            (steps,) = rp.copy_ceiling(prepared, 3, min_match=min_match)
            assert sum(a + 1 for a in steps) == len(target) - 1
            fewest = {len(target): 0}
            for n in range(len(target) - 1, 0, -1):  # n tokens of the answer known
                ctx = np.asarray(prompt + target[:n])
                best = max(rp.longest_copy(src, ctx, target[n:-1], 3, min_match)
                           for src in (rp.concat_with_separators(refs), ctx))
                fewest[n] = 1 + min(fewest[n + a + 1] for a in range(best + 1))
            assert len(steps) == fewest[1]
        (steps,) = rp.copy_ceiling(prepared, 3)
        again = [("a", prompt, refs, target), ("b", prompt, refs, target)]
        first, second = rp.copy_ceiling(again, 3, earlier_answers=True)
        assert first == steps
        assert len(second) == -(-(len(target) - 1) // 4)  # the answer itself, remembered: 3 drafts a step


def test_replay_at_exact_lengths_sends_only_what_is_accepted():
    """The length oracle of the suffix replay: the same drafts, each cut to what gets accepted, so every draft
    token sent is accepted (sent per step = tokens per step - 1), where the policy sends some that are not."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    prepared = []
    for i in range(6):
        doc = rng.integers(5, 40, 60).tolist()
        target = doc[10:30] + rng.integers(5, 40, 8).tolist() + doc[40:55]
        prepared.append((str(i), rng.integers(5, 40, 12).tolist() + doc[:5], [doc], target))
    policy = rp.replay(prepared, 10)
    exact = rp.replay(prepared, 10, exact_lengths=True)
    assert exact["sent_per_step"] == pytest.approx(exact["tokens_per_step"] - 1)
    assert policy["sent_per_step"] > exact["sent_per_step"] > 0


def test_the_ceiling_oracle_takes_the_cheapest_steps():
    """benchmarks/experiments/ceilings.py: the shortest path over plain, copy and draft-model steps."""
    ceilings = load("ceilings")
    verify = lambda L: 1.0 + 0.1 * L  # noqa: E731 (a forward over 1 + L tokens, in plain steps)
    copy = [0, 3, 0, 0, 0, 0]  # 6 tokens: after the first, a copy of 3 accepted, then plain steps
    assert ceilings.oracle_ms(copy, None, verify, 0.5, 100.0) == pytest.approx(1.3 + 1.0)
    assert ceilings.oracle_ms([0] * 6, None, verify, 0.5, 100.0) == pytest.approx(5.0)  # greedy: 5 plain steps
    model = [0, 4, 0, 0, 0, 0]  # a 4-token draft accepted at the second token: 1.4 + 5 x 0.5 for all 5
    assert ceilings.oracle_ms([0] * 6, model, verify, 0.5, 0.0) == pytest.approx(1.4 + 2.5)
    assert ceilings.oracle_ms([0] * 6, model, verify, 0.5, 10.0) == pytest.approx(1.4 + 2.5 + 10.0)  # its prefill
    assert ceilings.oracle_ms(copy, model, verify, 0.5, 0.0) == pytest.approx(2.3)  # copying is cheaper here
    # what a copy accepts: the source's continuation of the context's last token, up to the answer's last but one
    assert ceilings.copy_lengths([5, 6], [[7, 1, 2, 3, 4]], [7, 1, 2, 3, 9]) == [0, 3, 2, 1, 0]


def test_the_edit_items_are_drawn_once_and_carry_the_file_as_prediction():
    spec = importlib.util.spec_from_file_location("edit_bench", EXPERIMENTS.parent / "edit_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def tokenizer(text):  # a word a token
        return {"input_ids": text.split()}

    items = bench.edit_items(bench.BUNDLED_EDITS, 5, 1500, tokenizer)
    assert [it["id"] for it in items] == [it["id"] for it in bench.edit_items(bench.BUNDLED_EDITS, 5, 1500, tokenizer)]
    assert len(items) == 5 and len({it["id"] for it in items}) == 5
    for it in items:
        before = it["prediction"]
        assert len(before) <= 1500 and it["references"] == [before] and before in it["messages"][1]["content"]
        assert it["max_new_tokens"] == int(1.5 * len(before.split())) + 64


def test_the_edit_replay_charges_each_step_what_the_engine_would():
    """A drafter's steps on a known answer: each keeps its draft up to the first wrong token plus the model's own
    next one, never drafts the answer's last token, and costs ``1 + slope L`` for ``L`` draft tokens sent."""
    er = load("edit_replay")
    assert er.ngram_steps([1, 2, 3], [1, 2, 3, 4, 5], 2, lambda ctx, k: [2, 3, 9][:k]) == [(2, 2), (0, 0)]
    assert er.ngram_steps([7], [1, 2, 3], 4, lambda ctx, k: [9, 9]) == [(1, 0), (0, 0)]  # wrong: one token a step
    assert er.ngram_steps([7], [1, 2, 3, 4], 8, lambda ctx, k: [2, 3, 4, 5]) == [(2, 2)]  # cut before the last
    s = er.summarise([[(2, 2), (0, 0)]], [[1, 2, 3, 4, 5]], 0.5)
    assert s["tokens_per_step"] == pytest.approx(5 / 3) and s["sent_per_step"] == pytest.approx(2 / 3)
    assert s["modelled_speedup_decoding"] == pytest.approx(4 / 3)  # 4 tokens after the first in 2 + 1 plain steps


def test_a_run_page_names_the_cpu_and_its_bfloat16_units():
    """bfloat16 timings differ by whole factors between a CPU with AMX and one without bf16 instructions (where a
    verify of 10 tokens can cost more than it saves): a timed run's page must say which CPU it ran on."""
    from rag_accel_lab.machine import cpu_description

    assert cpu_description("model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n") == (
        "AMD EPYC (AVX2, no bfloat16 instructions)")
    assert cpu_description("model name\t: Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n") == (
        "Xeon (AVX-512, AVX-512 BF16, AMX)")
    assert cpu_description("model name\t: Xeon\nflags\t\t: avx2 avx512f\n") == "Xeon (AVX-512)"
    assert "AVX" not in cpu_description("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64: no x86 flags
    assert isinstance(cpu_description(), str) and cpu_description()  # this machine's, whatever it is


def test_graph_steps_times_every_path_and_counts_equal_rows():
    """The GPU script's measurement, run on a CPU on the tiny shape in bfloat16 (its static steps eager here): the
    paths timed for every draft length, every verify row of k = 1..32 at three cache lengths compared, and on the
    exact path (where the probe kept sizes) every one equal."""
    pytest.importorskip("transformers")
    graph_steps = load("graph_steps")
    run = graph_steps.measure("tiny", "bfloat16", context=24, reps=1, warmup=0, device="cpu")
    # (exact: where the probe keeps no size, as on a CPU whose attention computes a row by its place among 33, no path)
    assert set(run["ms"]) == {"eager", "static"} | ({"exact"} if run["exact_sizes"] else set())
    for path in ("eager", "static"):
        assert set(run["ms"][path]) == {str(k) for k in graph_steps.KS} and min(run["ms"][path].values()) > 0
        assert 0 <= run["rows"][path]["equal"] <= run["rows"][path]["total"] == 3 * sum(range(1, 33))
    if run["exact_sizes"]:  # (its steps hold at most its largest kept size, as the decoder's drafts on it)
        top = run["exact_sizes"][-1]
        assert set(run["ms"]["exact"]) == {str(k) for k in graph_steps.KS if k + 1 <= top}
        assert run["rows"]["exact"]["equal"] == run["rows"]["exact"]["total"] == 3 * sum(range(1, min(32, top) + 1))


def test_the_gpu_engine_script_runs_its_steps_stage_and_packs_it(tmp_path):
    """The prepared GPU run's first stage, on a CPU on the tiny shape: graph_steps' three files packed into one
    archive (the device tool brings back few files); an unknown stage is refused."""
    import os
    import subprocess
    import sys
    import tarfile

    pytest.importorskip("transformers")
    script = EXPERIMENTS / "gpu_engine.sh"
    env = {**os.environ, "DEVICE": "cpu", "SHAPES": "tiny", "REPS": "1", "PYTHON": sys.executable}
    root = EXPERIMENTS.parents[1]
    done = subprocess.run(["bash", str(script), "steps", str(tmp_path / "gpu")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with tarfile.open(tmp_path / "gpu.tgz") as tgz:
        assert {"gpu/graph_steps.json", "gpu/graph_steps.md"} <= set(tgz.getnames())
    md = (tmp_path / "gpu" / "graph_steps.md").read_text()
    assert "| tiny bfloat16 | eager |" in md and "| tiny bfloat16 | static |" in md and "- tiny bfloat16: exact" in md
    wrong = subprocess.run(["bash", str(script), "stepz", str(tmp_path / "x")], cwd=root, env=env,
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unknown stage stepz" in wrong.stderr


def test_gpu_ceiling_prices_padded_steps_and_bounds_our_drafting_by_the_oracle():
    """The GPU ceiling's replay on an answer copied whole from its reference, at flat step costs: the oracle
    decodes it in one step after the first token (5 plain steps' time in 1), our drafting takes no fewer steps;
    a step is priced at the static size that holds it."""
    ceiling = load("gpu_ceiling")
    assert ceiling.step_ms({1: 2.0, 3: 3.0, 5: 3.5}, 3, (1, 2, 4, 5)) == 3.25  # (3 tokens run as 4)
    answer = [50, 51, 52, 53, 54, 55]
    prepared = [("item", [1, 2, 3], [[40, 41, *answer, 42]], answer)]
    row = ceiling.ceilings(prepared, {1: 1.0, 17: 1.0}, k=8, host_ms=0.0, prefill_ms=0.0)
    assert row["oracle"] == 5.0 and row["oracle_tokens_per_step"] == 3.0  # (the prefill's step and one more)
    assert 1.0 <= row["ours"] <= row["oracle"] and row["ours_oracle_lengths"] <= row["oracle"]
    slow = ceiling.ceilings(prepared, {1: 1.0, 17: 1.0}, k=8, host_ms=0.0, prefill_ms=10.0)
    assert slow["oracle"] == round((10 + 5) / (10 + 1), 3)  # (a prefill shared by both dilutes the ratio)
