"""The second real model, Gemma 3 270M (google/gemma-3-270m, the base model; issue 57), on the
transformers path in float32: greedy outputs equal ``model.generate(do_sample=False)`` token for token
with drafts always right, always wrong and mixed, on RAG prompts whose answers cross the 512-token
sliding window of 15 of its 18 layers while they are drafted, and on prompts already past it.

Its cache keeps only the window in those layers, so a draft rejected after the window moved could not
be rolled back: ``rag_accel.hf.kv.new_cache`` makes it record its past until each step's rollback
(tests/test_kv.py checks the cache itself; tests/test_exactness.py a tiny Gemma-shaped model). The
vLLM engine on the same model: tests/test_vllm.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OracleDrafter, rag_completion_ids

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.models import GEMMA_MODEL

# one worker runs the module (the README's --dist loadgroup): its fixtures convert and load the model and decode
# the greedy answers once, not once per worker (117-143 s each in CI)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma")]

MAX_NEW = 64
WRONG = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def gemma():
    return ReferenceDecoder.from_pretrained(GEMMA_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def cases(gemma):
    """(prompt ids, greedy answer) for two MS-MARCO items as completion prompts, cut from the front
    (after <bos>) to 480 tokens (the answer crosses the window) and 600 (past it from the start)."""
    tok, model = gemma.tokenizer, gemma.model
    out = []
    for ids in rag_completion_ids(tok, (480, 600)):
        assert ids[0] == tok.bos_token_id
        x = torch.tensor([ids])
        with torch.inference_mode():
            want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW)
        out.append((ids, want[0, len(ids):].tolist()))
    return out


def test_the_model_is_gemma3_with_a_512_token_window(gemma):
    cfg = gemma.model.config
    assert cfg.model_type.startswith("gemma3") and cfg.sliding_window == 512 and cfg.vocab_size == 262_144
    assert cfg.layer_types.count("sliding_attention") == 15 and cfg.layer_types.count("full_attention") == 3
    assert next(gemma.model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("mode", ["right", "wrong", "mix"])
def test_greedy_equals_generate_across_the_sliding_window(gemma, cases, mode):
    """Oracle drafts of 8 tokens every step (tests/helpers.py): all right, all wrong (each token off by one),
    or right up to a random wrong token."""
    cfg = DecoderConfig(adaptive=False, max_draft_tokens=8)
    for i, (ids, want) in enumerate(cases):
        assert len(ids) + len(want) > 512 and len(want) == MAX_NEW  # (no early EOS: the window is crossed)
        out = gemma.generate(ids, max_new_tokens=MAX_NEW, config=cfg,
                             drafters=[OracleDrafter(want, len(ids), mode, gemma.vocab_size, seed=i)])
        assert out.token_ids == want, (i, mode)
        s = out.stats
        if mode == "right":
            assert s.accepted == s.drafted and s.steps <= MAX_NEW / 4, s
        if mode == "wrong":
            assert s.accepted == 0 and s.steps == MAX_NEW, s


def test_references_draft_on_gemma_and_stay_exact(gemma, cases):
    """The product path: the item's passages, then the answer itself, as references (its tokenizer)."""
    ids, want = cases[0]
    text = gemma.tokenizer.decode(want)
    for refs in ([text], [WRONG, text]):
        out = gemma.generate(ids, references=refs, max_new_tokens=MAX_NEW)
        assert out.token_ids == want
        assert out.stats.by_drafter["reference"]["accepted"] > MAX_NEW // 2, out.stats


def test_smollm2_drafting_for_gemma_with_another_tokenizer_is_exact(gemma, cases, real_decoder):
    """Universal assisted generation between two real models: SmolLM2-135M-Instruct (a 49k vocabulary)
    drafts for Gemma 3 270M (262k) through text; the output is Gemma's own greedy output."""
    dec = ReferenceDecoder(gemma.model, gemma.tokenizer, draft_model=real_decoder.model,
                           draft_tokenizer=real_decoder.tokenizer)
    assert dec.universal
    ids, want = cases[0]
    out = dec.generate(ids, max_new_tokens=32, config={"drafters": ("draft_model",), "adaptive": False})
    assert out.token_ids == want[:32]
    assert out.stats.by_drafter["draft_model"]["drafted"] > 0, out.stats
