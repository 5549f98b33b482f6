"""Our proposer in vLLM's parallel layouts, on this CPU: tensor parallel 2 in process, data parallel 2
through ``rag-accel serve``, pipeline parallel refused by name.

The model is a small random-weight Llama whose head counts divide by 2 (4 query, 2 KV heads; SmolLM2's
9 heads refuse TP 2), saved to a folder with SmolLM2's tokenizer. What matters is exactness against
the same engine with speculation off for the request (``speculate=False``), token for token, with
drafts always right (the answer itself as the reference), none, and always wrong; and that drafts
are accepted, as the rank that drafts reports them. Random weights repeat themselves, so prompt
lookup drafts too.

Without vLLM installed the module is skipped, unless RAG_ACCEL_REQUIRE_VLLM=1 (CI), where that is
an error.
"""

from __future__ import annotations

import os

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()

from rag_accel.vllm import VllmDecoder  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["Water boils at", "List of colours: red, green, blue, red, green,", "The history of Paris begins",
           "One, two, three, four,"]
MAX_NEW = 30
WRONG = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 4-layer random Llama (hidden 128, 4 heads, 2 KV heads) with SmolLM2's tokenizer, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from rag_accel.models import default_model_path

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, vocab_size=len(tok),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                      initializer_range=0.2)  # decisive logits: no near-ties for float32 to flip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _exact_and_drafting(generate):
    """Each prompt: speculation off for the request, then right / no / wrong references; all equal."""
    accepted = 0
    for prompt in PROMPTS:
        off = generate(prompt, None, speculate=False)
        for refs in ([off.text], None, [WRONG]):
            on = generate(prompt, refs)
            assert on.token_ids == off.token_ids, (prompt, refs)
            if refs == [off.text] and on.stats.accepted is not None:
                accepted += on.stats.accepted
    return accepted


@pytest.mark.slow
def test_tensor_parallel_2_is_exact_and_drafts_on_every_rank(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    dec = VllmDecoder.from_pretrained(tiny_llama, tensor_parallel_size=2, max_model_len=1024, enforce_eager=True)
    try:
        accepted = _exact_and_drafting(
            lambda p, r, **kw: dec.generate(p, r, max_new_tokens=MAX_NEW, **kw))
        right = dec.generate(PROMPTS[0], [dec.generate(PROMPTS[0], max_new_tokens=MAX_NEW, speculate=False).text],
                             max_new_tokens=MAX_NEW)
    finally:
        dec.close()
    assert accepted > len(PROMPTS) * MAX_NEW // 2  # the answer as its reference: most tokens come from drafts
    ref = right.stats.by_drafter["reference"]  # per-drafter stats, from the ranks that draft
    assert ref["accepted"] > 0 and right.stats.steps < right.stats.new_tokens


def test_pipeline_parallel_is_refused_before_an_engine_starts(tiny_llama):
    with pytest.raises(ValueError, match="does not run with pipeline parallelism"):
        VllmDecoder.from_pretrained(tiny_llama, pipeline_parallel_size=2)


@pytest.mark.slow
def test_data_parallel_2_through_the_server_is_exact_and_drafts(tiny_llama, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from rag_accel.serving.remote import RemoteDecoder
    from rag_accel.serving.server_process import Server

    # vLLM places each engine's threads itself: an inherited binding of both cores (test_vllm.py sets 0-1 for
    # its engines) made both data-parallel engines bind the same cores and fail to start (CI, 2026-11-25).
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with Server(tiny_llama, options=["--max-model-len", "1024"],
                vllm_args=["--data-parallel-size", "2", "--enforce-eager"], env=env) as srv:
        dec = RemoteDecoder(srv.base_url)
        drafts0, accepted0 = srv.spec_decode_counters()

        def generate(p, r, **kw):
            return dec.generate(p, r, max_new_tokens=MAX_NEW, **kw)

        _exact_and_drafting(generate)
        with ThreadPoolExecutor(4) as pool:  # in flight together: both engines get requests
            offs = list(pool.map(lambda p: generate(p, None, speculate=False), PROMPTS))
            ons = list(pool.map(lambda po: generate(po[0], [po[1].text]), zip(PROMPTS, offs)))
        assert [o.token_ids for o in ons] == [o.token_ids for o in offs]
        drafts1, accepted1 = srv.spec_decode_counters()
    assert accepted1 - accepted0 > len(PROMPTS) * MAX_NEW // 2


ENGINE_SCRIPT = """
import os
import sys
import tempfile
def made(event, args):  # (a folder this process makes in the system's temporary folder)
    if event == "os.mkdir" and os.path.dirname(os.path.abspath(args[0])) == tempfile.gettempdir():
        print("MKDIR", args[0], flush=True)
sys.addaudithook(made)
from rag_accel.vllm import VllmDecoder
if __name__ == "__main__":
    dec = VllmDecoder.from_pretrained(sys.argv[1], max_model_len=512, enforce_eager=True)
    print("OUT", dec.generate("One, two, three, four,", ["five, six"], max_new_tokens=6).token_ids, flush=True)
    dec.close()
"""


COMPILED_SCRIPT = """
import sys
from rag_accel.vllm import VllmDecoder
if __name__ == "__main__":
    dec = VllmDecoder.from_pretrained(sys.argv[1], dtype="bfloat16", max_model_len=512)
    for prompt in ("One, two, three, four,", "The capital of France is", "def add(a, b):"):
        print("OUT", dec.generate(prompt, max_new_tokens=12).token_ids, flush=True)
    dec.close()
"""


@pytest.mark.slow
def test_a_second_start_loads_the_compiled_model_and_answers_as_the_first(tiny_llama, tmp_path):
    """vLLM's CPU platform compiles with torch's own backend, whose saved function vLLM failed to load (it lacks
    vLLM's finalize_loading), so every start compiled again; with patch 6 a second start under the same
    RAG_ACCEL_HOME loads it, and its answers (bfloat16, exact steps) are the first start's, token for token."""
    import subprocess
    import sys

    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(RAG_ACCEL_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    runs = [subprocess.run([sys.executable, str(script), tiny_llama], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=600) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0 and done.stdout.count("OUT [") == 3, done.stderr[-3000:]
    first, second = (done.stdout + done.stderr for done in runs)
    assert "saved AOT compiled function" in first and "Directly load AOT compilation" not in first
    assert "Directly load AOT compilation" in second and "Compiling model again" not in second
    outputs = [[ln for ln in done.stdout.splitlines() if ln.startswith("OUT")] for done in runs]
    assert outputs[0] == outputs[1]


def _vllm_leftovers(folder) -> set[str]:
    """What vLLM and torch leave in a temporary folder: its processes' sockets, ``vllm_dist_*`` files, inductor's
    ``torchinductor_*`` folder; and an engine's own folder (``rag-accel-vllm-*``) not removed."""
    import stat
    from pathlib import Path

    out = set()
    for p in Path(folder).iterdir():
        try:
            sock = stat.S_ISSOCK(p.lstat().st_mode)
        except OSError:
            continue
        if sock or p.name.startswith(("vllm", "torchinductor", "rag-accel-vllm")):
            out.add(p.name)
    return out


@pytest.mark.slow
def test_an_engine_from_python_starts_as_the_servers_and_leaves_nothing_behind(tiny_llama, tmp_path):
    """VllmDecoder's engine writes its caches under RAG_ACCEL_HOME and its temporary files (its processes'
    sockets, the file their process group starts from) in a folder of its own, removed when it closes: the system's
    temporary folder is left as it was (vLLM alone leaves seven sockets there per start), even where RAG_ACCEL_HOME
    is too deep for a socket's path. From a shell that sets nothing, its threads are bound to the free cores and
    its processes run Intel OpenMP, as rag-accel serve's, and Intel OpenMP's files in /dev/shm go at close."""
    import subprocess
    import sys
    from pathlib import Path

    from rag_accel.machine import free_core_list

    home = tmp_path / "home"
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {k: v for k, v in os.environ.items()  # (a user's shell: nothing of vLLM's set)
           if k not in ("TMPDIR", "TEMP", "TMP", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH",
                        "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE")}
    system_tmp = "/tmp"  # (where Python puts temporary files without TMPDIR, TEMP or TMP)
    before, openmp_before = _vllm_leftovers(system_tmp), set(Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*"))
    done = subprocess.run([sys.executable, str(script), tiny_llama], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "RAG_ACCEL_HOME": str(home), "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0 and "OUT [" in done.stdout, done.stderr[-3000:]
    assert _vllm_leftovers(system_tmp) - before == set()
    made = [ln for ln in done.stdout.splitlines() if ln.startswith("MKDIR")]  # (the caller's, even where the
    # folder was there before: torch makes its cache folder as vLLM is imported)
    assert made and all("rag-accel-vllm-" in ln for ln in made), made
    assert (home / "vllm").is_dir()  # (its caches' place)
    # and it started as rag-accel serve's engine does: its threads bound to the free cores (vLLM's own binding
    # keeps one of 2 back), its processes on Intel OpenMP, whose files in /dev/shm go at close
    log = done.stdout + done.stderr
    if Path(sys.prefix, "lib", "libiomp5.so").is_file():
        assert "without Intel OpenMP" not in log and "libiomp is not found" not in log, log[-3000:]
    if free_core_list() is not None:
        assert "auto_setup=False" in log and "reserved_cpus=[]" in log, log[-3000:]
    assert set(Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*")) - openmp_before == set()
