"""Exact steps inside vLLM's CPU worker (rag_accel/vllm/exact.py): in bfloat16 every row of a forward gets the bits
it would get alone, so speculation (ours, vLLM's n-gram) and the batch change no output, no logit.

These fail on one bit. Without an engine: vLLM's attention kernel on the head shapes of the offline models (pieces
beside other requests against one-token steps), vLLM's oneDNN product in the chunks exact mode picks (every row
against the row alone). In real engines (bfloat16, exact mode on by default): tiny random Llama, Qwen2 and Gemma 3
models (Gemma's 32-token sliding window crossed), then SmolLM2 (compiled, as vLLM runs by default) and
Qwen2.5-Coder-0.5B: each request's token ids AND its logprobs equal, ``==`` on floats, to the same request's plain
decoding (``speculate=False``), with drafts always right, always wrong and mixed, alone, 4 and 16 in flight; the
Llama's also equal across engines without speculation and with vLLM's own n-gram speculation.
"""

from __future__ import annotations

import gc
import os
import shutil

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()

import torch  # noqa: E402
from helpers import fresh_verdicts, needs_bf16_units  # noqa: E402

from rag_accel.invariant import VERDICTS  # noqa: E402
from rag_accel.rag.msmarco import load_msmarco_sample, rag_completion, rag_messages  # noqa: E402
from rag_accel.vllm import VllmDecoder  # noqa: E402
from rag_accel.vllm.exact import MAX_CHUNK, exact_kernel, piece_rows, pieces_are_exact  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")

ENGINE = dict(max_model_len=2048, enforce_eager=True, dtype="bfloat16", max_draft_tokens=10)
NEW = 48


# --------------------------------------------------------------------------- kernels, no engine
def _attention_isas() -> list[str]:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return sorted({_get_attn_isa(torch.bfloat16, 128, 64), "vec"})


@pytest.fixture(scope="module", autouse=True)
def _amx():
    torch._C._cpu._init_amx()  # (vLLM's worker asks the kernel for AMX tiles; a test process must too)


@pytest.mark.parametrize("shape", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 1, 256)],
                         ids=["smollm2", "qwen-0.5b", "qwen-1.5b", "gemma-270m"])
def test_attention_pieces_are_one_token_steps(shape):
    """Each request's query rows, sent as exact mode's pieces beside a decode row and a prefill chunk, are bit for
    bit each row's one-token step, on every ISA this CPU runs (the sliding window too). (Sent whole, 33 rows of the
    1.5B's and Gemma's head shapes are not, on a 2-core AMX machine: the kernel sizes key tiles by the rows a work
    item holds.)"""
    for isa in _attention_isas():
        rows = piece_rows(isa, *shape[:2])
        assert rows >= 1
        assert pieces_are_exact(isa, *shape, torch.bfloat16, rows), (isa, rows)
        assert pieces_are_exact(isa, *shape, torch.bfloat16, rows, window=512), (isa, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_products_give_every_row_its_bits_alone(dtype):
    """The product exact mode picks for a weight gives every row of any number of rows (a verify, a batch, a
    prefill) the row's bits alone, with and without a bias."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((960, 576), (576, 1536), (4864, 896)):
        weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        for bias in (None, torch.randn(n, generator=gen).to(dtype)):
            kernel, _ = exact_kernel(weight, bias)
            x = torch.randn(300, k, generator=gen).to(dtype)
            alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
            assert torch.allclose(alone.float(), torch.nn.functional.linear(x, weight, bias).float(),
                                  rtol=2e-2, atol=2e-2)
            for m in (*range(2, MAX_CHUNK + 3), 47, 128, 129, 300):
                assert torch.equal(kernel(x[:m]), alone[:m]), (n, k, m, bias is not None)


# --------------------------------------------------------------------------- real engines
def _save(model, tokenizer_dir: str, path) -> str:
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


def _tiny(arch: str, tmp_path_factory) -> str:
    """A tiny random model of ``arch`` in a folder vLLM loads (head sizes its CPU attention takes)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    from rag_accel.models import local_model

    smol = local_model("smollm2-135m-instruct")
    common = dict(intermediate_size=512, num_hidden_layers=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":  # SmolLM2's grouping (3 query heads a key/value head), head size 32
        cfg, tok = LlamaConfig(vocab_size=49152, hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                               head_dim=32, **common), smol
    elif arch == "qwen2":  # q/k/v biases, 4 query heads on 2, head size 64
        cfg, tok = Qwen2Config(vocab_size=49152, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               use_sliding_window=False, **common), smol
    else:  # Gemma 3: a 32-token sliding window beside full attention, one key/value head of 64
        cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=64,
                               sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                               query_pre_attn_scalar=64, **common)
        tok = local_model("gemma-3-270m")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    return _save(model, tok, tmp_path_factory.mktemp(f"tiny-{arch}"))


def _prompts(dec, n: int) -> list[list[int]]:
    """The sample's first ``n`` questions over their passages: chat prompts where the tokenizer has a template."""
    chat = getattr(dec.tokenizer, "chat_template", None)
    return [dec.encode_prompt(rag_messages(it.query, it.passages) if chat else rag_completion(it.query, it.passages))
            for it in load_msmarco_sample(limit=n)]


def _generate(dec, prompts, refs, speculate=True):
    """(token ids, logprobs of the top 5 at every position) of each request, all in flight at once."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, detokenize=False,
                             extra_args={"references": r or [], "speculate": speculate}) for r in refs]
    outs = dec.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _draft_kinds(prompt: list[int], plain: list[int], vocab: int) -> dict[str, list[list[int]]]:
    context = prompt + plain
    return {
        "right": [context],
        "wrong": [context[len(prompt) + j - 4:len(prompt) + j] + [(t + 1) % vocab for t in plain[j:j + 10]]
                  for j in range(0, len(plain), 2)],  # each step's context tail, then wrong tokens
        "mixed": [[t if i % 5 != 3 else (t + 7) % vocab for i, t in enumerate(context)]],
    }


def _check_exact(dec, prompts):
    """Every request with drafts right, wrong and mixed (alone, 4 and 16 in flight, the kinds interleaved) gives
    the token ids and logprobs of its plain decoding, alone."""
    plain = [_generate(dec, [p], [None], speculate=False)[0] for p in prompts]
    kinds = [_draft_kinds(p, out[0], dec.vocab_size) for p, out in zip(prompts, plain)]
    jobs = [(i, kind) for kind in ("right", "wrong", "mixed") for i in range(len(prompts))]
    for level in (1, 4, 16):
        for start in range(0, len(jobs), level):
            group = jobs[start:start + level]
            got = _generate(dec, [prompts[i] for i, _ in group], [kinds[i][kind] for i, kind in group])
            for (i, kind), out in zip(group, got):
                assert out[0] == plain[i][0], (i, kind, level)
                assert out[1] == plain[i][1], (i, kind, level)  # every logprob, bit for bit
    return plain


def _close(dec):
    dec.close()
    del dec
    gc.collect()


@pytest.mark.slow
@needs_bf16_units
def test_tiny_llama_is_exact_across_speculation_drafts_batches_and_engines(tmp_path_factory):
    """One tiny Llama, three bf16 engines: no speculation, vLLM's n-gram, ours. The same 16 requests alone and
    16 in flight give the same ids and logprobs on all three; ours with every kind of draft, at 1, 4 and 16 in
    flight, equals its own plain decoding."""
    path = _tiny("llama", tmp_path_factory)
    outputs = {}
    try:
        for speculation in ("off", "ngram", "ours"):
            dec = VllmDecoder.from_pretrained(path, speculation=speculation, **ENGINE)
            try:
                assert dec.exact
                prompts = _prompts(dec, 16)
                outputs[speculation] = [_generate(dec, [p], [None])[0] for p in prompts[:4]]
                outputs[speculation + "-16"] = _generate(dec, prompts, [None] * 16)
                if speculation == "ours":
                    _check_exact(dec, prompts[:6])
            finally:
                _close(dec)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert outputs["off-16"][:4] == outputs["off"]  # batch invariance without speculation
    for speculation in ("ngram", "ours"):
        assert outputs[speculation] == outputs["off"], speculation
        assert outputs[speculation + "-16"] == outputs["off-16"], speculation


@pytest.mark.slow
@needs_bf16_units
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tiny_qwen2_and_gemma3_are_exact_with_any_drafts(arch, tmp_path_factory):
    path = _tiny(arch, tmp_path_factory)
    try:
        dec = VllmDecoder.from_pretrained(path, **ENGINE)
        try:
            assert dec.exact
            _check_exact(dec, _prompts(dec, 6))
        finally:
            _close(dec)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@needs_bf16_units
@pytest.mark.parametrize("model,compiled", [("smollm2-135m-instruct", True), ("qwen2.5-coder-0.5b-instruct", False)])
def test_offline_models_are_exact_in_bfloat16(model, compiled):
    """SmolLM2 as vLLM runs it by default (torch.compile), the 0.5B eager: ids and logprobs of plain decoding with
    any drafts, alone and in flight."""
    engine = {**ENGINE, "enforce_eager": not compiled}
    dec = VllmDecoder.from_pretrained(model, **engine)
    try:
        assert dec.exact
        plain = _check_exact(dec, _prompts(dec, 5))
        assert sum(len(ids) for ids, _ in plain) > 2 * NEW  # (answers, not stops at once)
    finally:
        _close(dec)


@pytest.mark.slow
def test_exact_can_be_turned_off_and_is_checked(tmp_path_factory):
    """A bad switch is refused before an engine starts; ``exact=False`` gives a bf16 engine whose worker runs
    vLLM's own kernels: its config's mode reaches it as "off" and it replaces no linear layer."""
    from rag_accel.vllm.patches import STATS_METHOD

    with pytest.raises(TypeError, match="exact must be a bool"):
        VllmDecoder.from_pretrained("smollm2-135m-instruct", exact="yes", **ENGINE)
    path = _tiny("llama", tmp_path_factory)
    try:
        dec = VllmDecoder.from_pretrained(path, exact=False, **ENGINE)
        try:
            assert not dec.exact
            status = [r["exact"] for r in dec.llm.collective_rpc(STATS_METHOD, args=([], False))]
            assert status == [{"mode": "off", "linears": 0, "attention": 0}]
            assert len(dec.generate([5, 6, 7], max_new_tokens=4).token_ids) == 4  # (it serves)
        finally:
            _close(dec)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_choice_is_remembered_for_the_next_process_and_a_damaged_file_measured_again(tmp_path, monkeypatch, caplog):
    """What the probes found on this machine is read back by the next process (no probe runs: a kernel that would
    fail is never called); a damaged file is set aside with a warning and the choice measured again."""
    from rag_accel.vllm import exact

    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path))
    fresh_verdicts(monkeypatch, exact.VERDICT_KIND)
    monkeypatch.setattr(exact, "_REMEMBERED", None)
    weight = (torch.randn(96, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    measured = exact.choose_linear(weight, None)
    path, _ = exact.choices_path()
    assert path.parent == tmp_path / "calibration" and path.is_file()
    VERDICTS.forget(exact.VERDICT_KIND)  # (a new process)
    monkeypatch.setattr(exact, "_REMEMBERED", None)
    real = exact._onednn_rows
    monkeypatch.setattr(exact, "_onednn_rows", lambda *a: pytest.fail("probed again"))
    assert exact.choose_linear(weight, None) == measured
    path.write_text(path.read_text().replace('"floor"', '"flour"'))
    VERDICTS.forget(exact.VERDICT_KIND)
    monkeypatch.setattr(exact, "_REMEMBERED", None)
    monkeypatch.setattr(exact, "_onednn_rows", real)
    exact.log.addHandler(caplog.handler)  # (vLLM's logger may not propagate to the root)
    try:
        assert exact.choose_linear(weight, None) == measured
    finally:
        exact.log.removeHandler(caplog.handler)
    assert "damaged" in caplog.text and '"floor"' in path.read_text()  # measured again, written whole


def test_a_vllm_build_without_the_packed_kernel_keeps_onednns_choice(tmp_path, monkeypatch):
    """vLLM builds for CPUs without AVX-512 leave out the weight-packed ops: exact mode then keeps oneDNN's choice
    and starts, rather than failing on the missing op."""
    from rag_accel.vllm import exact

    monkeypatch.setenv("RAG_ACCEL_HOME", str(tmp_path))
    fresh_verdicts(monkeypatch, exact.VERDICT_KIND)
    monkeypatch.setattr(exact, "_REMEMBERED", None)

    def missing(*_):
        raise AttributeError("'_OpNamespace' '_C' object has no attribute 'convert_weight_packed'")

    monkeypatch.setattr(exact, "_packed_rows", missing)
    weight = (torch.randn(96, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    choice = exact.choose_linear(weight, None)
    assert choice.kernel == "onednn" and choice.chunk > 0
