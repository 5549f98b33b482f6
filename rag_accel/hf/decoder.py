"""Lossless reference decoding: draft from references / context, verify in one forward.

The output token ids equal ``model.generate(do_sample=False)`` of the same model: every emitted token is the
model's own argmax given everything before it; drafts only decide how many of those argmaxes one forward computes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from .kv import rollback_cache
from .loading import check_draft_model, check_model, decoder_config, eos_token_ids, exact_steps, load, model_greedy
from .request import RequestState, SetUp
from .draft_models import new_drafter
from .sampling import GumbelNoise, Sampling, gumbel_argmax, model_sampling, warp
from .static import StaticLease, release
from .steps import Steps, measure_draft_costs
from .threads import free_cores
from ..config import DecoderConfig
from ..drafters import Draft, Drafter, chain_order
from ..inputs import check_lengths, check_stops, encode_prompt
from ..models import announced
from ..outputs import GenerationOutput, GenerationStats, GenerationStream
from ..policy import AcceptanceStats, leading_matches
from ..prediction import with_prediction
from ..protocol import CallOptions, Request, batch_arguments, call_config
from ..references import ReferenceSetUp, TokenCache, check_request_references, encode_references
from ..speculation import RequestDrafting, StepCosts
from ..stopping import OutputText

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GenerationOutput", "GenerationStats", "GenerationStream", "ReferenceDecoder"]


class ReferenceDecoder:
    """Greedy decoding of a Hugging Face causal LM, accelerated by copying drafts from reference documents (LLMA) and
    from the prompt and output so far (the frequency drafter; prompt lookup, ANPD's n-gram tables and a draft model,
    ``draft_tokenizer`` where its tokenizer is its own, on request), verified losslessly. One decoder may be shared
    by threads: calls take turns on the model step by step.

    Example:
        >>> dec = ReferenceDecoder.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
        >>> out = dec.generate([{"role": "user", "content": q}], references=passages)  # doctest: +SKIP
        >>> out.text, out.token_ids, out.stats.tokens_per_step  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, config: DecoderConfig | None = None, *,
                 draft_model: Any = None, draft_tokenizer: Any = None, exact: bool | None = None,
                 static_steps: bool | None = None) -> None:
        self.vocab_size = check_model(model, tokenizer)
        self.model, self.tokenizer, self.config = model, tokenizer, decoder_config(config, draft_model is not None)
        self.eos_token_ids: frozenset[int] = eos_token_ids(model, tokenizer)
        # the forwards: cache, forward path, plans, probes and cost curves; its lock serialises the model's use,
        # held for one step of a call, never across a stream's yield (see _decode)
        self.steps = Steps(model, exact=exact_steps(model, exact), static_steps=static_steps,
                           max_draft_tokens=self.config.max_draft_tokens, draft_model=draft_model)
        self.context_window: int | None = self.steps.context_window
        self._lock = self.steps.lock
        self.acceptance = AcceptanceStats()  # learnt across requests; see reset_learning()
        self.reference_tokens = TokenCache()  # reference texts tokenised lately (a passage that comes back)
        self.clock = time.perf_counter  # what the step timing reads (a test may inject its own)
        # what a draft model's token and catch-up cost, and a plain step, measured at calibration (the learnt
        # step costs start from it: a first request prices the draft model before it asks it)
        self.draft_costs: StepCosts | None = None
        self.step_costs = StepCosts()  # what verify steps and draft-model tokens really cost, learnt online
        self.draft_model, self.draft_tokenizer = draft_model, draft_tokenizer
        self._universal = draft_model is not None and check_draft_model(tokenizer, draft_model, draft_tokenizer)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device: Any = None, dtype: Any = None,
                        config: DecoderConfig | None = None, draft_model: str | None = None, calibrate: bool = True,
                        exact: bool | None = None, static_steps: bool | None = None,
                        **model_kwargs: Any) -> ReferenceDecoder:
        """Load model and tokenizer from a hub name or local folder (``"smollm2-135m-instruct"``: the offline
        default). One way per engine: vLLM's is :meth:`rag_accel.vllm.VllmDecoder.from_pretrained` (the same surface).

        ``draft_model``: a second model to draft with (its own tokenizer: a different one selects universal
        drafting), or ``"int8"``: an int8 copy of the model itself (CPU). ``calibrate``: time the projections'
        layouts and what verifying 1..``max_draft_tokens`` draft tokens costs now, remembered per machine, so that
        no request pays it (``False``: the first request does). ``exact``: verify steps compute every row bit for
        bit as a one-token step does (default: on a CPU in bfloat16 and float16; ``docs/how-it-works.md``).
        ``static_steps``: steps on one preallocated KV cache captured as CUDA graphs (default: on a GPU, for models
        without sliding-window layers)."""
        if "backend" in model_kwargs:
            raise ValueError(f"ReferenceDecoder is the transformers decoder and takes no backend= (got "
                             f"{model_kwargs['backend']!r}): for vLLM use rag_accel.vllm.VllmDecoder.from_pretrained"
                             f"(name, ...), which has the same surface")
        model, tokenizer, draft, draft_tokenizer = load(name_or_path, device, dtype, draft_model, **model_kwargs)
        dec = cls(model, tokenizer, config, draft_model=draft, draft_tokenizer=draft_tokenizer, exact=exact,
                  static_steps=static_steps)
        cal = dec.steps.open_calibration(getattr(draft, "name_or_path", None) if draft_model != "int8" else None)
        if calibrate and dec.config.adaptive:
            measuring = dec.draft_model is not None or not dec.steps.calibrated(dec.config.max_draft_tokens)
            threads = torch.get_num_threads()
            with (announced(f"calibrating {name_or_path} on this machine ({threads} thread{'s' * (threads > 1)})"
                            + (f"; remembered in {cal.path.parent}" if cal else "") + " ...")
                  if measuring else nullcontext()):
                dec.cost_curve(dec.config.max_draft_tokens)
        return dec

    # ------------------------------------------------------------ the forwards (rag_accel.hf.steps)
    @property
    def device(self) -> torch.device:
        return self.steps.device

    @property
    def exact(self) -> bool:  # (every row computed as it would be alone: chosen once, at construction)
        return self.steps.exact

    @property
    def universal(self) -> bool:
        """Whether the draft model has a tokenizer of its own (universal drafting)."""
        return self._universal

    @property
    def static_steps(self) -> bool:
        """Whether requests' steps run on the static cache in fixed sizes (:mod:`rag_accel.hf.static`)."""
        return self.steps.static_steps

    def plan_linears(self) -> dict:
        """The layout of each projection's few-row products, timed once and installed (:meth:`Steps.plan_linears
        <rag_accel.hf.steps.Steps.plan_linears>`)."""
        return self.steps.plan_linears()

    def cost_curve(self, max_draft: int, pack_gqa: bool | None = None,
                   fast_linears: bool | None = None, exact: bool | None = None) -> tuple[float, ...]:
        """Relative cost of verifying 0..max_draft draft tokens (the config's, or measured once per length bound
        and forward path: ``pack_gqa``, ``fast_linears``, ``exact``, by default the steps' own); a draft model's
        costs are measured with the first curve."""
        if self.config.cost_curve is not None:
            return self.config.cost_curve
        curve = self.steps.cost_curve(max_draft, pack_gqa, fast_linears, exact)
        if self.draft_model is not None and self.draft_costs is None:
            self.draft_costs = measure_draft_costs(self.steps, self.draft_model)
            self._seed_step_costs(self.step_costs)
        return curve

    def _seed_step_costs(self, costs: StepCosts) -> None:
        """Learnt step costs not learnt yet start from the calibration's measurement."""
        if self.draft_costs is not None:
            for name in ("step_s", "draft_token_s", "catchup_token_s"):
                if getattr(costs, name) is None:
                    setattr(costs, name, getattr(self.draft_costs, name))

    # ------------------------------------------------------------ input checks
    def encode_prompt(self, prompt: Any) -> list[int]:
        """Prompt as token ids (see :func:`rag_accel.inputs.encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def encode_references(self, references: Any, max_tokens: int | None = None) -> list[list[int]]:
        """References as token-id lists (see :func:`rag_accel.references.encode_references`)."""
        limit = self.config.max_reference_tokens if max_tokens is None else max_tokens
        return encode_references(self.tokenizer, references, self.vocab_size, limit)

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

        Args:
            prompt: string, chat messages, or token ids.
            references: documents to copy from: a list of strings or token-id lists; one string is one reference
                (``None`` or empty: the drafters over the prompt and output only).
            drafters: use these drafters instead of the configured chain.
            options: the options every decoder takes (:class:`~rag_accel.protocol.CallOptions`). Sampled drafts are
                verified by speculative sampling with a point-mass draft (:mod:`rag_accel.hf.sampling`).

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
        check_lengths(len(prompt_ids), req.max_new_tokens, self.context_window)
        t0 = self.clock()
        refs, given = check_request_references(self.tokenizer, with_prediction(req.references, req.prediction),
                                               req.answers, self.vocab_size, cfg.max_reference_tokens,
                                               self.reference_tokens)
        encode_s = self.clock() - t0
        sampling = model_sampling(req.sampling, self.model)
        return GenerationStream(self._decode(prompt_ids, refs, given, req.max_new_tokens, req.stops, cfg, drafters,
                                             sampling, encode_s))

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
        """The baseline: the model's own ``generate(do_sample=False)`` on the same prompt, with :meth:`generate`'s
        arguments and output (``stats.steps``: one forward per token)."""
        stops = check_stops(stop)
        prompt_ids = self.encode_prompt(prompt)
        check_lengths(len(prompt_ids), max_new_tokens, self.context_window)
        with self._lock:
            return model_greedy(self.model, self.tokenizer, self.eos_token_ids, prompt_ids, max_new_tokens, stops)

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
        """The decode loop: 0. prefill (the request's drafting set up on a thread meanwhile: :class:`SetUp
        <rag_accel.hf.request.SetUp>`), then per step 1. emit, 2. draft, 3. verify, 4. accept and roll back,
        5. account. The model lock is held for one step at a time, never across a ``yield``: a stream may be iterated
        from any thread, one dropped half-read holds nothing, and calls on one decoder take turns step by step."""
        t_start = self.clock()
        if self.device.type == "cpu":
            free_cores().before_call()  # (where the library owns torch's threads and the load may have changed)
        with self._lock, torch.inference_mode():
            req = self._start(prompt_ids, max_new_tokens, stops, cfg, sampling)
            setup, new_tokens = self._begin(req, refs, answers, custom_drafters, encode_s)  # 0.
        try:
            while True:
                piece = self._emit(req, new_tokens)  # 1.
                if piece:
                    yield piece
                if req.out.finish is not None:
                    break
                with self._lock, torch.inference_mode():
                    t0 = self.clock()
                    self._learn(req, setup, new_tokens)
                    draft, sent = self._draft(req)  # 2.
                    t1 = self.clock()
                    preds = self._verify(req, sent)  # 3.
                    seconds = self.clock() - t1  # (the predictions' .tolist() synchronised the device)
                    new_tokens = self._accept(req, sent, preds)  # 4.
                    self._account(req, draft, sent, len(new_tokens) - 1, t1 - t0, seconds)  # 5.
        finally:  # ended, failed or dropped half-read: references not indexed yet are not needed
            setup.stop()
            release(req.cache)
        stats = req.stats
        stats.new_tokens, stats.finish_reason = len(req.out.token_ids), req.out.finish
        stats.time_s = self.clock() - t_start
        return GenerationOutput(text=req.out.text, token_ids=req.out.token_ids, stats=stats)

    def _start(self, prompt_ids: list[int], max_new_tokens: int, stops: list[str], cfg: DecoderConfig,
               sampling: Sampling | None) -> RequestState:
        """A request's state: its cost curve (measured on a first call), cache and output."""
        t0 = self.clock()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        if cfg.cost_curve is not None:
            curve = cfg.cost_curve
        elif cfg.adaptive:
            had = self.steps.curves_measured()
            curve = self.cost_curve(cfg.max_draft_tokens)
            if self.steps.curves_measured() > had:  # measured for this request
                stats.calibration_s = self.clock() - t0
        else:
            curve = (1.0,) * (cfg.max_draft_tokens + 1)
        out = OutputText(self.tokenizer, stops, self.eos_token_ids, max_new_tokens)
        # (a static cache holds the prompt, the answer and the largest step's padding)
        cache = self.steps.new_cache(len(prompt_ids) + max_new_tokens + cfg.max_draft_tokens + 1)
        return RequestState(list(prompt_ids), cache, None, out, stats, cfg, sampling, curve)

    def _begin(self, req: RequestState, refs: list, answers: list, custom_drafters: Sequence[Drafter] | None,
               encode_s: float) -> tuple[SetUp, list[int]]:
        """0. The whole prompt in one forward, its argmax (or a sample) the first new token, while the request's
        drafting is set up on a thread (a failure hands the static cache back)."""
        try:
            refs_setup = None
            if custom_drafters is None and "reference" in req.cfg.drafters and any(len(r) for r in [*refs, *answers]):
                refs_setup = ReferenceSetUp(refs, answers, lambda: self.tokenizer, req.cfg.max_reference_tokens,
                                            self.reference_tokens)
            setup = SetUp(lambda: self._set_up_drafting(req, custom_drafters), refs_setup)
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
            req.drafting_ready()
            return setup, new_tokens
        except BaseException:
            release(req.cache)
            raise

    def _set_up_drafting(self, req: RequestState, custom_drafters: Sequence[Drafter] | None) -> None:
        """The request's drafting over its prompt, its references left out (runs during the prefill, which reads
        none of it; its :class:`~rag_accel.references.ReferenceSetUp` adds them)."""
        t0 = self.clock()
        draft_model = None if self.draft_model is None else (
            lambda: new_drafter(self.draft_model, self.draft_tokenizer, self.tokenizer, self._universal))
        req.drafting = RequestDrafting.from_config(req.cfg, req.context, [], req.cost_curve, self.acceptance,
                                                   self.step_costs, drafters=custom_drafters,
                                                   draft_model=draft_model)
        req.stats.setup_s = self.clock() - t0

    def _prefill(self, req: RequestState) -> list[int]:
        """The whole prompt in one forward; its argmax (or a sample) is the first new token."""
        t0 = self.clock()
        steps = self.steps
        last = steps.forward(req.context, req.cache, last_only=True, fast_linears=steps.fast_linears)[-1:]  # [1, V]
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

    @staticmethod
    def _emit(req: RequestState, new_tokens: list[int]) -> str:
        """1. The step's tokens into the output, up to EOS, a stop string or ``max_new_tokens``: its new text."""
        n_kept, piece = req.out.push(new_tokens)
        req.context.extend(new_tokens[:n_kept])
        return piece

    def _learn(self, req: RequestState, setup: SetUp, new_tokens: list[int]) -> None:
        """The drafters index the step's tokens (and the references join once they are indexed)."""
        req.stats.setup_s += setup.join(req.drafting, chain_order(req.cfg.drafters))
        req.drafting.learn(req.context, new_tokens)

    def _draft(self, req: RequestState) -> tuple[Draft, list[int]]:
        """2. The draft to verify and the tokens of it worth sending (none: a plain step)."""
        n_generated = len(req.out.token_ids)
        draft, n_send = req.drafting.choose(req.context, n_generated, req.out.max_new_tokens - n_generated)
        if isinstance(req.cache, StaticLease):  # (no more than the largest step holds: exact steps may drop sizes)
            n_send = min(n_send, req.cache.steps.sizes[-1] - 1)
        return draft, draft.tokens[:n_send]

    def _verify(self, req: RequestState, sent: list[int]) -> list[int]:
        """3. One forward over [last token + draft] on top of the cache: the model's token at each position (its
        argmax, or its sample for that position)."""
        steps = self.steps
        logits = steps.forward([req.context[-1]] + sent, req.cache, pack_gqa=steps.pack_gqa,
                               fast_linears=steps.fast_linears, exact=steps.exact)  # [1 + len(sent), V]
        if req.sampling is None:
            return logits.argmax(-1).tolist()
        pos = len(req.out.token_ids)
        req.noise.forget_before(pos)
        return gumbel_argmax(warp(logits, req.warpers), req.noise.rows(pos, pos + 1 + len(sent))).tolist()

    @staticmethod
    def _accept(req: RequestState, sent: list[int], preds: list[int]) -> list[int]:
        """4. The longest draft prefix equal to the model's tokens, plus its next token; the cache rolled back to
        the kept tokens (the new last token is not cached yet)."""
        n_acc = leading_matches(sent, preds)
        rollback_cache(req.cache, len(sent) - n_acc)
        return sent[:n_acc] + [preds[n_acc]]

    @staticmethod
    def _account(req: RequestState, draft: Draft, sent: list[int], n_acc: int, draft_s: float,
                 seconds: float) -> None:
        """5. What the step cost and kept, for the drafting's policy and the request's stats."""
        req.drafting.account(len(sent), n_acc, seconds, len(req.context))
        req.stats.draft_s += draft_s
        req.stats.record_step(draft.source if sent else "", len(sent), n_acc)
