"""What the transformers decoder checks and resolves when it is built (dtype and device, the model and its
tokenizer, the generation config, the exact-steps choice, a draft model), and the model's own greedy decoding, the
baseline it is compared with."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..invariant import EXACT_DTYPES

# Generation-config settings that change greedy outputs and that the decoder does not apply: refuse rather than
# silently differ from generate().
UNSUPPORTED_GENERATION_SETTINGS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "min_new_tokens": None,
    "min_length": 0,
    "renormalize_logits": False,
}

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """``None``/"auto": on a GPU bfloat16 (float16 where it has none), on a CPU float32; else the name's dtype."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def resolve_device(device: Any = None) -> torch.device:
    """``None``/"auto": CUDA when available, else CPU. Asking for CUDA without one is an error."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available here; use device='cpu'")
    return dev


def load(name_or_path: str, device: Any, dtype: Any, draft_model: str | None, **model_kwargs: Any) -> tuple:
    """``(model, tokenizer, draft model, its tokenizer)`` loaded on the resolved device and dtype (a draft model
    ``"int8"``: an int8 copy of the model, sharing its tokenizer); on a CPU torch computes on the free cores."""
    from ..models import int8_draft_model, load_model_and_tokenizer
    from .threads import free_cores

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if dev.type == "cpu":
        free_cores().at_load()  # (the free cores, where the program left torch's threads as torch set them)
    model, tokenizer = load_model_and_tokenizer(name_or_path, dev, torch_dtype, **model_kwargs)
    draft = draft_tokenizer = None
    if draft_model == "int8":
        draft = int8_draft_model(model)
    elif draft_model is not None:
        draft, draft_tokenizer = load_model_and_tokenizer(draft_model, dev, torch_dtype)
    return model, tokenizer, draft, draft_tokenizer


def check_model(model: Any, tokenizer: Any) -> int:
    """A causal LM and its own tokenizer, or a clear error; returns the model's vocabulary size."""
    if not hasattr(model, "forward") or not hasattr(model, "config"):
        raise TypeError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
    if not callable(getattr(tokenizer, "decode", None)) or not callable(tokenizer):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer/model mismatch: the tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"has {vocab_size} rows; load the tokenizer that belongs to this model"
        )
    check_generation_config(getattr(model, "generation_config", None))
    return vocab_size


def decoder_config(config: Any, has_draft_model: bool) -> Any:
    """The decoder's :class:`~rag_accel.config.DecoderConfig` (default: the default one, with the draft model's
    drafter where a draft model is given), or a clear error."""
    from ..config import DEFAULT_COPY_DRAFTERS, DecoderConfig

    if config is None and has_draft_model:  # a draft model given is a draft model asked for
        config = DecoderConfig(drafters=(*DEFAULT_COPY_DRAFTERS, "draft_model"))
    config = config or DecoderConfig()
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
    if has_draft_model and "draft_model" not in config.drafters:
        raise ValueError(f"a draft model was given but config.drafters={config.drafters} does not list "
                         f"'draft_model'; add it (e.g. drafters=('reference', 'frequency', 'draft_model')) "
                         f"or load no draft model")
    return config


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS as generate() sees it: the model's generation config (the tokenizer's only without one)."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = gen_cfg.eos_token_id if gen_cfg is not None else tokenizer.eos_token_id
    return frozenset([] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos]))


def check_generation_config(gen_cfg: Any) -> None:
    if gen_cfg is None:
        return
    for name, default in UNSUPPORTED_GENERATION_SETTINGS.items():
        value = getattr(gen_cfg, name, default)
        if value is not None and value != default:
            raise ValueError(
                f"model.generation_config.{name}={value!r} changes greedy outputs and is not applied by "
                f"ReferenceDecoder; set it to {default!r} (and pass it explicitly to generate() when comparing)"
            )


def exact_steps(model: Any, exact: bool | None) -> bool:
    """Whether steps run exact (by default: :data:`~rag_accel.invariant.EXACT_DTYPES` on a CPU; on a GPU the
    invariant plans and the row attention are unmeasured, ``exact=True`` asks for them): the model must route its
    attention through transformers' "sdpa" function, which the row-by-row attention replaces."""
    if exact is not None and not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool or None, got {type(exact).__name__}")
    param = next(model.parameters())
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if exact is None:
        exact = param.dtype in EXACT_DTYPES and param.device.type == "cpu"
        if exact and impl != "sdpa":
            warnings.warn(f"this model's attention is {impl!r}, not 'sdpa': its {param.dtype} verify steps are not "
                          "made exact (drafting on may differ from drafting off by a near tie); load it with "
                          "attn_implementation='sdpa' for exact steps", stacklevel=4)
            return False
    elif exact and impl != "sdpa":
        raise ValueError(f"exact=True needs the model's attention on transformers' 'sdpa' function, not {impl!r}: "
                         "load it with attn_implementation='sdpa'")
    return exact


def check_draft_model(tokenizer: Any, draft_model: Any, draft_tokenizer: Any) -> bool:
    """Validate the draft model; True when it needs the universal (different-tokenizer) drafter."""
    from .draft_models import check_model as check_draft

    check_draft(draft_model, "draft_model")
    if draft_tokenizer is not None and (not callable(draft_tokenizer)
                                        or not callable(getattr(draft_tokenizer, "decode", None))):
        raise TypeError(f"draft_tokenizer must be a Hugging Face tokenizer, got {type(draft_tokenizer).__name__}")
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        if not getattr(draft_tokenizer, "is_fast", False):
            raise ValueError("a draft model with a different tokenizer needs a fast tokenizer (character offsets)")
        return True
    rows = int(draft_model.get_input_embeddings().weight.shape[0])
    if rows < len(tokenizer):
        raise ValueError(
            f"the draft model's embedding has {rows} rows but the tokenizer has {len(tokenizer)} tokens; "
            "pass draft_tokenizer=<its own tokenizer> for a draft model with a different vocabulary"
        )
    return False


def model_greedy(model: Any, tokenizer: Any, eos_ids: frozenset[int], prompt_ids: list[int], max_new_tokens: int,
                 stops: list[str]) -> Any:
    """The baseline: the model's own ``generate(do_sample=False)`` on ``prompt_ids``, as a
    :class:`~rag_accel.outputs.GenerationOutput` (``stats.steps``: one forward per token)."""
    import time

    from ..outputs import GenerationOutput, GenerationStats

    extra: dict[str, Any] = {"stop_strings": stops, "tokenizer": tokenizer} if stops else {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        x = torch.tensor([prompt_ids], device=next(model.parameters()).device)  # [1, S]
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                             **extra)
        generated = out[0, len(prompt_ids):].tolist()  # syncs the device
        elapsed = time.perf_counter() - t0
    text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
    elif generated and generated[-1] in eos_ids:
        finish = "eos"
    else:
        finish = "length"
    stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(generated), steps=len(generated),
                            finish_reason=finish, time_s=elapsed)
    return GenerationOutput(text=text, token_ids=generated, stats=stats)
