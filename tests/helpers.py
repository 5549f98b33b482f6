"""Test helpers: tiny random models of several architectures, plain greedy, an oracle drafter."""

from __future__ import annotations

import random

import torch

from rag_accel import Draft


def tiny_model(arch: str, vocab_size: int, seed: int = 0, eos_token_id=None):
    """A randomly initialised 2-layer model of the given architecture (no download)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, use_sliding_window=False, **common)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
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
