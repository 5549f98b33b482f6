"""The model class users deploy (issue 63): Qwen2.5-Coder-0.5B-Instruct, the real model (grouped KV heads,
q/k/v biases, an untied head, a 152k vocabulary, ChatML), on the transformers path in float32: greedy outputs
equal ``model.generate(do_sample=False)`` token for token with drafts always right, always wrong and mixed,
with the planned projections (tests/test_linears.py) taking every step, and with the references drafting.
Its 1.5B sibling is in the benchmarks, not in CI; the vLLM engine on the 0.5B: tests/test_vllm.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OracleDrafter

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.rag.msmarco import load_msmarco_sample, rag_messages
from rag_accel.models import QWEN_DRAFT_MODEL

# one worker runs the module (the README's --dist loadgroup): its fixtures convert and load the model and decode
# the greedy answers once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("qwen")]

MAX_NEW = 32


@pytest.fixture(scope="module")
def qwen():
    return ReferenceDecoder.from_pretrained(QWEN_DRAFT_MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def cases(qwen):
    """(prompt ids, generate's greedy answer, passages) for two items of the bundled sample's last ones, as chat
    prompts (the model's own template)."""
    out = []
    for it in load_msmarco_sample(with_answers=True)[-2:]:
        ids = qwen.encode_prompt(rag_messages(it.query, it.passages))
        x = torch.tensor([ids])
        with torch.inference_mode():
            want = qwen.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW)
        out.append((ids, want[0, len(ids):].tolist(), it.passages))
    return out


def test_the_model_is_a_qwen2_with_grouped_kv_heads_biases_and_an_untied_head(qwen):
    cfg, model = qwen.model.config, qwen.model
    assert cfg.model_type == "qwen2" and cfg.num_attention_heads == 14 and cfg.num_key_value_heads == 2
    assert cfg.vocab_size == 151_936 and not cfg.tie_word_embeddings
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert qwen.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>system")


@pytest.mark.parametrize("mode", ["right", "wrong", "mix"])
def test_greedy_equals_generate_with_right_wrong_and_mixed_drafts(qwen, cases, mode, monkeypatch):
    """Oracle drafts of 6 tokens every step (tests/helpers.py), every step on the planned projections."""
    from rag_accel.hf import linears

    planned = []
    real = linears.planned_linear

    def counting(hidden, weight, bias, plan):
        planned.append(hidden.numel() // hidden.shape[-1])
        return real(hidden, weight, bias, plan)

    monkeypatch.setattr(linears, "planned_linear", counting)
    cfg = DecoderConfig(adaptive=False, max_draft_tokens=6)
    for i, (ids, want, _) in enumerate(cases):
        out = qwen.generate(ids, max_new_tokens=MAX_NEW, config=cfg,
                            drafters=[OracleDrafter(want, len(ids), mode, qwen.vocab_size, seed=i)])
        assert out.token_ids == want, (i, mode)
        s = out.stats
        if mode == "right":  # every token but each step's own one came from a draft (past an early EOS: none)
            assert s.accepted >= len(want) - s.steps and s.steps <= len(want) / 3, s
        if mode == "wrong":
            assert s.accepted == 0 and s.steps == len(want), s
    if any(plan.changes for plan in qwen.plan_linears().values()):  # (what this CPU's timing chose)
        assert 7 in planned  # 1 + 6 draft rows through the wrapped projections


def test_references_draft_on_qwen_and_stay_exact(qwen, cases):
    """The product path (adaptive, the default chain): the item's passages, then the answer itself too."""
    for ids, want, passages in cases:
        assert qwen.generate(ids, references=passages, max_new_tokens=MAX_NEW).token_ids == want
    ids, want, passages = cases[0]
    out = qwen.generate(ids, references=[*passages, qwen.tokenizer.decode(want)], max_new_tokens=MAX_NEW)
    assert out.token_ids == want
    assert out.stats.accepted > MAX_NEW // 2, out.stats
