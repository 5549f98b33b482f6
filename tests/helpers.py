"""Test helpers: tiny random models of several architectures, plain greedy, an oracle drafter."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rag_accel import Draft


def tiny_model(arch: str, vocab_size: int, seed: int = 0, eos_token_id=None, context: int = 1024):
    """A randomly initialised 2-layer model of the given architecture (no download); ``context``: the
    Llama's context window."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=context, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, use_sliding_window=False, **common)
    elif arch == "qwen2-h128":  # Qwen2.5-1.5B's heads (12 of 128 on 2 key/value heads): exact steps batch their rows
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=12,
                          num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, use_sliding_window=False,
                          **common)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    elif arch == "gemma3":  # sliding-window attention (an 8-token window) beside full attention, as Gemma 3's
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=16, sliding_window=8, max_position_embeddings=1024,
                               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                               **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id if eos_token_id is not None else 0
    model.generation_config.bos_token_id = None
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


class OracleDrafter:
    """Drafts from the known greedy output: right, wrong (every token off by one) or mixed."""

    name = "oracle"

    def __init__(self, target, prompt_len, mode, vocab, seed=0):
        self.target, self.prompt_len, self.mode, self.vocab = target, prompt_len, mode, vocab
        self.rng = random.Random(seed)

    def propose(self, context, max_len):
        pos = len(context) - self.prompt_len
        true = list(self.target[pos:pos + max_len])
        true += [0] * (max_len - len(true))  # past the end of the target: arbitrary tokens
        if self.mode == "wrong":
            return Draft([(t + 1) % self.vocab for t in true], 1, self.name)
        if self.mode == "mix":
            k = self.rng.randrange(len(true) + 1)
            true = true[:k] + [(t + 1) % self.vocab for t in true[k:k + 1]] + true[k + 1:]
        return Draft(true, 1, self.name)

    def update(self, context, num_new):
        pass


def permuted_pair(model, tokenizer, seed=0):
    """The same model and tokenizer with their vocabulary ids shuffled: a tokenizer that is
    "different" (other ids) yet segments text as the original, and a model that predicts the
    same text. As a draft for the original, it is always right through universal drafting."""
    import copy
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    rows = model.get_input_embeddings().weight.shape[0]
    perm = list(range(rows))
    random.Random(seed).shuffle(perm)  # old id -> new id
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["model"]["vocab"] = {t: perm[i] for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        added["id"] = perm[added["id"]]
    spec["post_processor"] = None
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    other = copy.deepcopy(model)
    index = torch.tensor(perm)
    with torch.no_grad():
        emb = other.get_input_embeddings().weight
        emb[index] = emb.clone()
        head = other.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != emb.data_ptr():
            head.weight[index] = head.weight.clone()
    return other, fast


def trained_bpe_tokenizer(texts, vocab_size=600):
    """A small byte-level BPE trained here on ``texts``: a genuinely different vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)




def rag_completion_ids(tokenizer, lengths=(480, 600), n_items=20):
    """Completion-style RAG prompts (for a base model) as token ids, one per length: the first MS-MARCO
    sample item long enough, cut from the front (after its first token, <bos>) to that many tokens."""
    from rag_accel.rag.msmarco import load_msmarco_sample, rag_completion

    prompts = [tokenizer(rag_completion(it.query, it.passages))["input_ids"]
               for it in load_msmarco_sample(limit=n_items)]
    out = []
    for length in lengths:
        ids = next(p for p in prompts if len(p) > length)
        out.append(ids[:1] + ids[len(ids) - length + 1:])
    return out


def fresh_verdicts(monkeypatch, kind: str) -> None:
    """This test starts with none of ``kind``'s probe verdicts known (``rag_accel.invariant.VERDICTS``), as a new
    process would; the table is put back after it."""
    from rag_accel.invariant import VERDICTS

    monkeypatch.setattr(VERDICTS, "_found", {k: dict(v) for k, v in VERDICTS._found.items() if k != kind})


def bf16_units() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX); elsewhere torch and vLLM emulate it,
    about 6x slower than float32 (an AVX2 EPYC: a 300 x 576 x 1536 product 96 ms against 14.5 ms).
    ``RAG_ACCEL_BF16_TESTS=1`` counts any CPU as having them (to run the real bf16 engines on an AVX2 machine)."""
    from rag_accel.machine import cpu_identity

    if os.environ.get("RAG_ACCEL_BF16_TESTS") == "1":
        return True
    units = cpu_identity().rpartition("[")[2]
    return "avx512_bf16" in units or "amx_bf16" in units


#: Real bfloat16 engines (start-up probes, prefills of ~1k tokens, dozens of requests) run where bf16 is in hardware:
#: on an AVX2 EPYC test_vllm_exact.py alone took 42 minutes (a fresh model cache; CI has 60 for everything), and the
#: real 0.5B's HF test 623 s. The kernel tests (products, attention pieces) and the main suite's tiny bf16 decoders
#: still check exactness there; ``RAG_ACCEL_BF16_TESTS=1`` runs the real engines anyway.
needs_bf16_units = pytest.mark.skipif(
    not bf16_units(), reason="bfloat16 is emulated on this CPU (no AVX-512 BF16 or AMX): its real bf16 engines take "
    "about 6x as long; RAG_ACCEL_BF16_TESTS=1 runs them")
