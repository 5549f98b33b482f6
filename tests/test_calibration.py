"""What a decoder measures at load is remembered for the next process on the machine (rag_accel/hf/calibration.py):
a later load measures nothing, a damaged or foreign file is measured again, never trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import fresh_verdicts, tiny_model

from rag_accel import ReferenceDecoder
from rag_accel.hf import attention, calibration
from rag_accel.hf import steps as steps_module


@pytest.fixture()
def folder(tmp_path, tokenizer, monkeypatch):
    """A tiny Llama saved as a model folder, and a fresh RAG_ACCEL_HOME."""
    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny"
    tiny_model("llama", vocab_size=len(tokenizer)).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _files(tmp_path):
    return sorted((tmp_path / "home" / "calibration").glob("*.json"))


def test_a_second_load_measures_nothing_and_gets_what_the_first_measured(folder, tmp_path, monkeypatch, capsys):
    first = ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    assert "calibrating" in capsys.readouterr().err
    assert first.exact and len(_files(tmp_path)) == 1
    first.generate("hello there", max_new_tokens=4)  # (the plans are installed at the first forward)

    def measured(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(steps_module, "measure_cost_curve", measured)
    monkeypatch.setattr(steps_module, "plan_linears", measured)
    monkeypatch.setattr(steps_module, "exact_plans", measured)
    second = ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    assert "calibrating" not in capsys.readouterr().err
    k = second.config.max_draft_tokens
    assert second.cost_curve(k) == first.cost_curve(k)
    assert second.plan_linears() == first.plan_linears()
    out = second.generate("hello there", max_new_tokens=8)
    assert out.token_ids == first.generate("hello there", max_new_tokens=8).token_ids


def test_a_damaged_or_foreign_file_is_measured_again(folder, tmp_path, capsys):
    ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    (path,) = _files(tmp_path)
    good = json.loads(path.read_text())
    damaged = [
        "{not json",
        json.dumps({**good, "key": {**good["key"], "threads": 999}}),  # another machine's key in this file
        json.dumps({**good, "sections": {**good["sections"], "cost_curves": [[[16, True, True, True], [2.0]]]}}),
        json.dumps({**good, "sections": {**good["sections"], "exact_plans": [[[64, 64, "torch.bfloat16"], 0, 1, 1]]}}),
    ]
    for text in damaged:
        path.write_text(text)
        capsys.readouterr()
        dec = ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
        err = capsys.readouterr().err
        assert "damaged" in err and "calibrating" in err, text[:60]
        dec.generate("hello", max_new_tokens=2)
        assert json.loads(path.read_text())["key"] == good["key"]  # measured and written again, whole


def test_the_key_holds_what_changes_a_measurement(folder, tmp_path):
    ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    ReferenceDecoder.from_pretrained(str(folder), dtype=torch.float32)  # another dtype: another file
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)  # another thread count: another file
    finally:
        torch.set_num_threads(threads)
    keys = [json.loads(p.read_text())["key"] for p in _files(tmp_path)]
    assert len(keys) == 3 and all(k["cpu"] == calibration.cpu_identity() for k in keys)
    assert calibration.model_identity(tmp_path / "nowhere") is None  # (a hub name: nothing remembered)


def test_attention_verdicts_are_remembered(folder, tmp_path, monkeypatch):
    ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    (path,) = _files(tmp_path)
    found = dict(json.loads(path.read_text())["sections"])["attention"]
    assert any(key[:3] == [4, 2, 16] for key, _ in found)  # the tiny Llama's heads, probed by its exact steps
    fresh_verdicts(monkeypatch, attention.VERDICT_KIND)
    monkeypatch.setattr(attention, "_probe", lambda *key: pytest.fail(f"probed again: {key}"))
    dec = ReferenceDecoder.from_pretrained(str(folder), dtype=torch.bfloat16)
    dec.generate("hello", [" hello there hello"], max_new_tokens=6)


@pytest.mark.slow
def test_a_later_process_starts_without_measuring(folder):
    """Two fresh processes: the first calibrates (and says so on stderr), the second loads and answers only."""
    code = ("import torch; from rag_accel import ReferenceDecoder; "
            f"d = ReferenceDecoder.from_pretrained({str(folder)!r}, dtype=torch.bfloat16); "
            "print(d.generate('hello there', max_new_tokens=4).token_ids)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert "calibrating" in runs[0].stderr and "calibrating" not in runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
