"""Exact steps inside vLLM's CPU worker: every row of a forward gets the bits it would get alone.

vLLM computes one forward over every scheduled row at once: one request's verify rows beside other requests'
decode rows and prefill chunks. A CPU kernel's reduction order can depend on how many rows it is given (a
product's blocking, attention's work split), so a verify row's logits differ from the one-token step's at the
same position, and a request's output depends on what else is in its batch. In exact mode each kernel whose
result could depend on its neighbours computes a row as it would alone:

- **Projections** (every linear layer and the output head, through vLLM's ``dispatch_cpu_unquantized_gemm``):
  the rows go to vLLM's own oneDNN kernel in chunks of at most ``c`` rows, ``c`` the largest count for which a
  probe on this layer's weight shape, on this machine, at the worker's thread count, finds every row of every
  chunk of ``1..c`` rows bit-equal to the row alone (:func:`rag_accel.invariant.invariant_rows`). Where ``c`` is
  under 16, oneDNN in calls of at least :data:`PADDED_ROWS` rows if the probe finds those invariant, else the torch
  plans of :mod:`rag_accel.invariant` where they give more rows. Where calls of up to :data:`LARGE_CHUNK` rows
  give every row those bits too, a prefill goes in calls that large. Where vLLM's weight-packed kernel (sgl-kernel's)
  gives every row of every count the bits of the row alone and is not clearly slower, it computes that weight instead
  (:func:`choose_linear`).
- **Attention** (``cpu_attn``): the kernel's scheduler may split one sequence's keys across threads
  (``VLLM_CPU_ATTN_SPLIT_KV``: off in this mode) and sizes its key tiles by how many query rows a work item
  holds. Each request's rows go to the kernel as pieces of at most as many rows as one of its query-head tiles
  holds, so every row is reduced over the same key tiles as a one-token step at its position, whatever else is
  in the batch. A probe checks this on the real kernel, head shape and ISA at the first step; where it fails,
  each row is its own piece (a one-token step's shape, by construction).

Everything else on the path (embedding, norms, rotary embedding, activation, the argmax) computes each row on
its own. Plain steps run through the same kernels, so speculation on and off compute the same logits, for any
proposer: ours, vLLM's n-gram and suffix decoding alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..invariant import (EXACT_CANDIDATES, EXACT_DTYPES, VERDICTS, ExactPlan, exact_linear, invariant_rows,
                         is_invariant, rows_agree)
from .requests import EXACT_KEY

log = logging.getLogger("vllm.rag_accel")  # (under vLLM's logger: its workers' log shows the mode)

#: How an engine's workers compute (its ``additional_config``'s :data:`~rag_accel.vllm.requests.EXACT_KEY`): "auto"
#: (exact steps for bfloat16 and float16 weights), "on" (every dtype), "off" or absent (vLLM's own kernels).
#: ``VllmDecoder`` and ``rag-accel serve`` set it ("auto" by default).
MODES = ("auto", "on", "off")
#: Rows one chunk of a projection may hold at most (oneDNN's handler keeps a primitive per row count up to 32).
MAX_CHUNK = 32
#: Query heads one tile of vLLM's CPU attention kernel holds, per ISA (``MaxQHeadNumPerIteration``).
ATTENTION_TILE_HEADS = {"amx": 32, "vec16": 16, "vec": 8}


def mode(vllm_config: Any) -> str:
    """An engine's mode, from its config (:data:`MODES`; none given: "off").

    Example:
        >>> from types import SimpleNamespace
        >>> mode(SimpleNamespace(additional_config={"rag_accel_exact": "auto"})), mode(None)
        ('auto', 'off')
    """
    extra = getattr(vllm_config, "additional_config", None)
    value = extra.get(EXACT_KEY, "off") if isinstance(extra, dict) else "off"
    if value not in MODES:
        raise ValueError(f"additional_config's {EXACT_KEY!r} must be one of {list(MODES)}, got {value!r}")
    return value


def active(mode: str, dtype: torch.dtype) -> bool:
    """Whether an engine in ``mode`` computes a model of ``dtype`` exactly."""
    return mode == "on" or (mode == "auto" and dtype in EXACT_DTYPES)


_STATUS = {"linears": 0, "attention": 0}


def status(vllm_config: Any) -> dict[str, Any]:
    """What exact mode changed in this worker: its engine's mode, the linear layers (the output head included)
    computed exactly, the attention groups whose query rows go as pieces (counted at their first step)."""
    return {"mode": mode(vllm_config), **_STATUS}


# --------------------------------------------------------------------------- projections
_KERNELS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
_KEYS_LOCK = threading.Lock()


# The op a traced graph calls (one per projection): registered through torch.library's low-level API, whose CPU kernel
# is the Python function itself; torch.library.custom_op wraps each call in checks of its own, which cost a compiled
# SmolLM2 step about 3 ms of 121 calls under the profiler.
_LIBRARY = torch.library.Library("rag_accel", "FRAGMENT")
_LIBRARY.define("exact_linear(Tensor x, int key, int n) -> Tensor")
_LIBRARY.impl("exact_linear", lambda x, key, n: _KERNELS[key](x), "CPU")


@torch.library.register_fake("rag_accel::exact_linear", lib=_LIBRARY)
def _(x: torch.Tensor, key: int, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _register(kernel: Callable[[torch.Tensor], torch.Tensor]) -> int:
    with _KEYS_LOCK:
        key = len(_KERNELS)
        _KERNELS[key] = kernel
    return key


def _onednn_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> RowKernel:
    """``rows(x, chunk, floor=1)``: ``F.linear(x, weight, bias)`` through vLLM's oneDNN kernel in calls of at most
    ``chunk`` rows, each at least ``floor`` rows (zero rows pad a shorter one)."""
    load_vllm_ops()
    n, k = weight.shape
    # (vLLM's create_onednn_mm keeps the handler's pointer in a tensor, so that a traced graph holds it as a constant)
    handle = torch.tensor(torch.ops._C.create_onednn_mm_handler(weight.t(), MAX_CHUNK), dtype=torch.int64)
    mm = torch.ops._C.onednn_mm

    def rows(x: torch.Tensor, chunk: int, floor: int = 1) -> torch.Tensor:
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if m <= chunk and m >= floor:  # (a plain step, a verify, a small batch: one call, as vLLM's own dispatch)
            out = torch.empty((m, n), dtype=x.dtype)
            mm(out, x2, bias, handle)
            return out.reshape(*x.shape[:-1], n)
        short = floor - (m - (m - 1) // chunk * chunk)  # rows the last call lacks
        x2 = torch.cat([x2, x2.new_zeros(short, k)]) if short > 0 else x2.contiguous()
        out = torch.empty((x2.shape[0], n), dtype=x.dtype)
        for i in range(0, x2.shape[0], chunk):
            mm(out[i:i + chunk], x2[i:i + chunk], bias, handle)
        return out[:m].reshape(*x.shape[:-1], n)

    return rows


def _packed_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> RowKernel:
    """``rows(x, chunk, floor=1)``: ``F.linear(x, weight, bias)`` through vLLM's weight-packed kernel (sgl-kernel's
    product, which vLLM itself runs for small weights on AMX CPUs) in calls of at most ``chunk`` rows (``floor``:
    unused, the probe never pads this kernel)."""
    load_vllm_ops()
    n, k = weight.shape
    packed = torch.ops._C.convert_weight_packed(weight.contiguous())
    bias = None if bias is None else bias.float()  # (as vLLM hands it over)
    linear = torch.ops._C.weight_packed_linear

    def rows(x: torch.Tensor, chunk: int, floor: int = 1) -> torch.Tensor:
        x2 = x.reshape(-1, k).contiguous()
        m = x2.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        if m <= chunk:  # (a step, a verify, a small batch: one call, no slicing, as every projection of a step runs)
            linear(out, x2, packed, bias, True)
        else:
            for i in range(0, m, chunk):
                linear(out[i:i + chunk], x2[i:i + chunk], packed, bias, True)
        return out.reshape(*x.shape[:-1], n)

    return rows


#: vLLM's CPU ops exact mode calls itself, with the arguments it passes (patches.check_internals checks them).
VLLM_OPS = {
    "create_onednn_mm_handler": ("b", "primitive_cache_size"),
    "onednn_mm": ("c", "a", "bias", "handler_tensor"),
    "convert_weight_packed": ("weight",),
    "weight_packed_linear": ("out", "mat1", "mat2", "bias", "is_vnni"),
    "get_scheduler_metadata": ("num_req", "num_heads_q", "num_heads_kv", "head_dim", "seq_lens", "dtype",
                               "query_start_loc", "casual", "window_size", "isa_hint", "enable_kv_split",
                               "dynamic_causal", "kv_cache_dtype"),
    "cpu_attention_with_kv_cache": ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens",
                                    "scale", "causal", "alibi_slopes", "sliding_window_size", "block_table", "softcap",
                                    "scheduler_metadata", "s_aux", "dynamic_causal", "k_scale", "v_scale",
                                    "kv_cache_dtype"),
}

#: Ops a vLLM build may leave out: its builds for CPUs without AVX-512 have no weight-packed kernel (exact mode then
#: keeps oneDNN's choice). Where they are, their arguments are checked as the others'.
OPTIONAL_VLLM_OPS = frozenset({"convert_weight_packed", "weight_packed_linear"})


def load_vllm_ops() -> None:
    """vLLM's CPU ops (``torch.ops._C``), registered when its layers' module is first imported."""
    import vllm.model_executor.layers.utils  # noqa: F401


#: Rows every oneDNN call holds at least where calls of fewer rows are not invariant (zero rows pad the rest): a
#: 1536-wide weight on an AMD EPYC with AVX-512 BF16 (results page: exact_costs_vllm_cpu_smollm2_bf16_epyc).
PADDED_ROWS = 4
#: Rows one call holds at most where calls of any count up to it are invariant: a prefill's rows go in a few calls
#: at the kernel's own speed rather than in :data:`MAX_CHUNK`-row ones.
LARGE_CHUNK = 128
#: Row counts past :data:`MAX_CHUNK` the probe for :data:`LARGE_CHUNK`-row calls tries.
LARGE_PROBES = (33, 47, 64, 100, LARGE_CHUNK)
#: Random inputs that probe tries: where a large call's blocking differs, most rows differ (an output head's probe
#: costs a 1.5B model about 2 s a trial).
LARGE_TRIALS = 3

#: ``rows(x, chunk, floor=1)``: a projection of ``x``'s rows in calls of at most ``chunk``, at least ``floor`` rows.
RowKernel = Callable[..., torch.Tensor]


#: The row kernels of vLLM's that a projection may run on: its oneDNN product (what vLLM runs on this CPU) and its
#: weight-packed product (sgl-kernel's).
KERNELS = ("onednn", "packed")
#: How much slower than the oneDNN choice the packed kernel may time on any of :data:`PACKED_TIMED_ROWS` and still be
#: chosen: only a kernel clearly slower is passed over, so that a machine's load cannot flip a near tie.
PACKED_SLACK = 1.25
#: The calls the two kernels are timed on: a step's row, a verify or small batch's rows, a prefill's.
PACKED_TIMED_ROWS = (1, 16, LARGE_CHUNK)


@dataclasses.dataclass(frozen=True)
class LinearChoice:
    """How exact mode computes one weight shape: one of vLLM's :data:`KERNELS` in calls of at most ``chunk`` and at
    least ``floor`` rows, or (``plan`` set) torch's kernels as :func:`rag_accel.invariant.exact_linear` computes that
    plan."""

    chunk: int
    plan: ExactPlan | None = None
    floor: int = 1
    kernel: str = "onednn"


#: :data:`~rag_accel.invariant.VERDICTS`' table of :func:`choose_linear`: (out, in, dtype, bias, threads) -> its
#: :class:`LinearChoice`.
VERDICT_KIND = "vllm linear"
#: The format of the choices remembered on disk: a change makes every file another key's.
CHOICES_VERSION = 2
_REMEMBERED: dict[str, LinearChoice] | None = None  # read from disk at the first choice of this process


def choices_path() -> tuple[Path, dict[str, Any]]:
    """Where this machine's choices are remembered (a file under ``$RAG_ACCEL_HOME/calibration``, as the
    transformers engine's calibration), and the key it holds: the CPU (its model and units), torch's and vLLM's
    versions. A choice's own key adds its weight's shape and dtype, the bias and the thread count."""
    import vllm

    from ..machine import cpu_identity
    from ..models import cache_home

    key = {"version": CHOICES_VERSION, "cpu": cpu_identity(), "torch": torch.__version__,
           "vllm": str(vllm.__version__)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_home() / "calibration" / f"vllm-exact-{digest}.json", key


def _read_choice(value: Any) -> LinearChoice:
    """A remembered choice, checked to be one :func:`choose_linear` can make (else ``ValueError``)."""
    chunk, floor, plan, kernel = value["chunk"], value["floor"], value["plan"], value["kernel"]
    if plan is not None:
        plan = ExactPlan(plan["chunk"], plan["transposed"], plan["pad"])
        if plan not in EXACT_CANDIDATES:
            raise ValueError(f"no such plan {plan}")
    if (type(chunk) is not int or not 0 <= chunk <= LARGE_CHUNK or floor not in (1, PADDED_ROWS)
            or floor > max(chunk, 1) or kernel not in KERNELS
            or (kernel == "packed" and (plan is not None or floor != 1 or chunk != LARGE_CHUNK))):
        raise ValueError(f"no such choice {value}")
    return LinearChoice(chunk, plan, floor, kernel)


def _remembered() -> dict[str, LinearChoice]:
    global _REMEMBERED
    if _REMEMBERED is None:
        _REMEMBERED = {}
        try:
            path, key = choices_path()
            if path.is_file():
                data = json.loads(path.read_text())
                if data.get("key") != key:
                    raise ValueError("it holds another key")
                _REMEMBERED = {k: _read_choice(v) for k, v in data["choices"].items()}
        except Exception as e:  # noqa: BLE001 - damaged or foreign: measured again, then overwritten
            log.warning("rag_accel: the remembered exact-mode choices are damaged (%s); measuring again", e)
            _REMEMBERED = {}
    return _REMEMBERED


def _remember(key: str, choice: LinearChoice) -> None:
    """Add a measured choice to the file (written whole: a temporary file renamed; a read-only home keeps none)."""
    remembered = _remembered()
    remembered[key] = choice
    try:
        path, file_key = choices_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": file_key, "choices": {
            k: {**dataclasses.asdict(c), "plan": None if c.plan is None else dataclasses.asdict(c.plan)}
            for k, c in remembered.items()}}))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("rag_accel: exact-mode choices not remembered (%s)", e)


def choose_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: RowKernel | None = None,
                  packed: RowKernel | None = None, seconds: Seconds | None = None) -> LinearChoice:
    """The cheapest invariant way to compute rows of ``weight`` here (probed once per shape, dtype, bias and
    thread count on this machine, and remembered on disk: :func:`choices_path`; ``rows`` and ``packed``: the row
    kernels, vLLM's by default, a test's fake ones never remembered; ``seconds``: how a call is timed):

    1. oneDNN in the largest chunk of at most :data:`MAX_CHUNK` rows that is invariant;
    2. where that is under 16 rows, oneDNN in calls of at least :data:`PADDED_ROWS` rows if those are invariant, else
       the torch plans of :data:`rag_accel.invariant.EXACT_CANDIDATES` where one gives larger chunks;
    3. oneDNN's calls of up to :data:`LARGE_CHUNK` rows, with the same floor, where every row of every count up to
       it equals the rows of step 1 or 2 (a prefill then runs in a few calls);
    4. the packed kernel in calls of up to :data:`LARGE_CHUNK` rows instead, where every row of every count equals
       the row alone and it is not clearly slower (:func:`_prefer_packed`)."""
    key = (*weight.shape, weight.dtype, bias is not None, torch.get_num_threads())
    disk_key = "{}x{}:{}:{}:{}".format(*key) if rows is None else None  # (a test's fake kernel: never remembered)

    def probe() -> LinearChoice:
        choice = _remembered().get(disk_key) if disk_key is not None else None  # (an earlier process's)
        if choice is None:
            choice = _probe_linear(weight, bias, rows, packed, seconds or _seconds)
            if disk_key is not None:
                _remember(disk_key, choice)
        return choice

    return VERDICTS.get(VERDICT_KIND, key, probe)


def _probe_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: RowKernel | None,
                  packed: RowKernel | None, seconds: Seconds) -> LinearChoice:
    """:func:`choose_linear`'s four steps, measured."""
    k, dtype = weight.shape[1], weight.dtype
    chunk = 0
    real = rows is None
    try:
        rows = rows or _onednn_rows(weight, bias)
        chunk = invariant_rows(lambda x: rows(x, MAX_CHUNK), k, dtype, MAX_CHUNK)
    except RuntimeError as e:  # oneDNN refuses this dtype on this CPU: the torch plans
        log.debug("rag_accel: oneDNN refused a %s weight (%s)", weight.dtype, e)
    choice = LinearChoice(chunk)
    if 0 < chunk < 16 and invariant_rows(lambda x: rows(x, PADDED_ROWS, PADDED_ROWS), k, dtype,
                                         MAX_CHUNK + 1) == MAX_CHUNK + 1:
        choice = LinearChoice(PADDED_ROWS, floor=PADDED_ROWS)
    elif chunk < 16:
        plan = next(p for p in EXACT_CANDIDATES if p.pad == 1 or is_invariant(weight, bias, p))
        if plan.chunk > chunk:
            choice = LinearChoice(plan.chunk, plan)
    if choice.plan is None and choice.chunk and large_calls_agree(rows, choice, k, dtype):
        choice = LinearChoice(LARGE_CHUNK, floor=choice.floor)
    if real and dtype in (torch.bfloat16, torch.float16):  # (sgl-kernel's product: 16-bit weights only)
        try:
            packed = _packed_rows(weight, bias)
        except (RuntimeError, AttributeError) as e:  # (refused, or not in this vLLM build: a CPU without AVX-512)
            log.debug("rag_accel: no packed kernel for a %s weight (%s)", tuple(weight.shape), e)
    return choice if packed is None else _prefer_packed(choice, rows, packed, k, dtype, seconds)


#: ``seconds(rows, choice, x)``: how long ``rows`` takes on ``x`` in ``choice``'s calls.
Seconds = Callable[[RowKernel, LinearChoice, torch.Tensor], float]


def _seconds(rows: RowKernel, choice: LinearChoice, x: torch.Tensor) -> float:
    """The least of a few timed calls (about 50 ms of them, 3 to 50), after an untimed one."""
    import time

    best = float("inf")
    with torch.inference_mode():
        rows(x, choice.chunk, choice.floor)
        for i in range(50):
            t0 = time.perf_counter()
            rows(x, choice.chunk, choice.floor)
            best = min(best, time.perf_counter() - t0)
            if i >= 2 and best * (i + 1) > 0.05:
                break
    return best


def _prefer_packed(choice: LinearChoice, rows: RowKernel, packed: RowKernel, in_features: int, dtype: torch.dtype,
                   seconds: Seconds) -> LinearChoice:
    """The packed kernel in calls of up to :data:`LARGE_CHUNK` rows where every row of every count gets the bits of
    the row alone (the probe of step 3, against one-row calls) and it is not clearly slower than ``choice``
    (:data:`PACKED_SLACK`, :data:`PACKED_TIMED_ROWS`); where oneDNN has no choice of its own (it refused the dtype,
    or only torch's plans are invariant), wherever it is invariant. Else ``choice``. Both are invariant: speed
    decides (results page: packed_kernel_vllm_cpu_smollm2_bf16)."""
    candidate = LinearChoice(LARGE_CHUNK, kernel="packed")
    try:
        if not large_calls_agree(packed, LinearChoice(1, kernel="packed"), in_features, dtype):
            return choice
    except RuntimeError as e:
        log.debug("rag_accel: the packed kernel failed (%s)", e)
        return choice
    if not choice.chunk or choice.plan is not None:
        return candidate
    x = torch.randn(LARGE_CHUNK, in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    slower = any(seconds(packed, candidate, x[:m]) > PACKED_SLACK * seconds(rows, choice, x[:m])
                 for m in PACKED_TIMED_ROWS)
    return choice if slower else candidate


def large_calls_agree(rows: RowKernel, choice: LinearChoice, in_features: int, dtype: torch.dtype,
                      trials: int = LARGE_TRIALS) -> bool:
    """Whether calls of up to :data:`LARGE_CHUNK` rows (at least ``choice.floor``) give every row of every count
    from ``choice.chunk`` + 1 to :data:`MAX_CHUNK` + 1 and of :data:`LARGE_PROBES` the bits ``choice``'s calls give
    it (``trials`` sets of random rows in ``dtype``; up to ``choice.chunk`` rows both make the same one call)."""
    counts = [*range(choice.chunk + 1, MAX_CHUNK + 2), *LARGE_PROBES]
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(trials):
            x = torch.randn(LARGE_CHUNK, in_features, generator=gen).to(dtype)
            want = rows(x, choice.chunk, choice.floor)
            if not rows_agree(lambda _, n: rows(x[:n], LARGE_CHUNK, choice.floor), want, ((0, n) for n in counts)):
                return False
    return True


def exact_kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                           bool]:
    """(the kernel exact mode computes ``F.linear(x, weight, bias)`` with, whether it still needs ``weight``)."""
    choice = choose_linear(weight, bias)
    plan = choice.plan
    if choice.kernel == "packed":
        packed = _packed_rows(weight, bias)
        return (lambda x: packed(x, choice.chunk)), False
    if plan is None:
        rows = _onednn_rows(weight, bias)
        return (lambda x: rows(x, choice.chunk, choice.floor)), False
    return (lambda x: exact_linear(x, weight, bias, plan)), True


def wrap_dispatch(original: Any) -> Any:
    """Patch 4 (:mod:`rag_accel.vllm.patches` applies it): each linear layer's ``cpu_linear`` in an exact engine."""
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        from vllm.config import get_current_vllm_config_or_none

        weight = layer.weight
        if (weight.is_meta or weight.ndim != 2 or weight.device.type != "cpu"
                or not active(mode(get_current_vllm_config_or_none()), weight.dtype)):  # (the model being loaded's)
            return original(layer, remove_weight)
        kernel, needs_weight = exact_kernel(weight.detach(), getattr(layer, "bias", None))
        key, n = _register(kernel), weight.shape[0]
        is_compiling = torch.compiler.is_compiling
        op = torch.ops.rag_accel.exact_linear.default

        def cpu_linear(x: torch.Tensor, weight: Any, bias: Any) -> torch.Tensor:
            # traced (torch.compile): one opaque op in the graph; eager: the kernel itself, without the dispatcher
            return op(x, key, n) if is_compiling() else kernel(x)

        layer.cpu_linear = cpu_linear
        if remove_weight and not needs_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        _STATUS["linears"] += 1

    dispatch_cpu_unquantized_gemm.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch_cpu_unquantized_gemm


# --------------------------------------------------------------------------- attention
def piece_rows(isa: str, num_heads: int, num_kv_heads: int) -> int:
    """How many query rows of one request the CPU attention kernel reduces exactly as one-token steps when they
    come as one sequence: as many as one of its query-head tiles holds (so its key tiles are sized for a full
    tile, as a one-token step's are); 1 for an ISA whose tile is unknown here."""
    heads = ATTENTION_TILE_HEADS.get(isa)
    if heads is None:
        return 1
    per_kv = num_heads // num_kv_heads
    grouped = per_kv if heads % per_kv == 0 else 1  # the kernel's own rule (GQA packing, else head by head)
    return max(1, heads // grouped)


def split_queries(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, rows: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each request's query rows as pieces of at most ``rows``, each its own sequence (ending where its last row
    is; its request's block table): ``(query_start_loc, seq_lens, block_table)`` of the pieces, or ``None`` where
    no request has more than ``rows`` rows.

    Example:
        >>> qsl, sl = torch.tensor([0, 1, 6], dtype=torch.int32), torch.tensor([9, 20], dtype=torch.int32)
        >>> q, s, b = split_queries(qsl, sl, torch.tensor([[7], [8]], dtype=torch.int32), 2)
        >>> q.tolist(), s.tolist(), b.flatten().tolist()
        ([0, 1, 3, 5, 6], [9, 17, 19, 20], [7, 8, 8, 8])
    """
    lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(lens.max()) <= rows:
        return None
    pieces = (lens + rows - 1) // rows  # per request
    req = torch.repeat_interleave(torch.arange(len(lens)), pieces.long())
    first = torch.cumsum(pieces, 0) - pieces  # each request's first piece
    j = torch.arange(len(req)) - first.long()[req]  # a piece's index in its request
    start = query_start_loc[:-1].long()[req] + j * rows
    end = torch.minimum(start + rows, query_start_loc[1:].long()[req])
    new_qsl = torch.cat([start, end[-1:]]).to(query_start_loc.dtype)
    new_seq = (seq_lens.long()[req] - (query_start_loc[1:].long()[req] - end)).to(seq_lens.dtype)
    return new_qsl, new_seq, block_table[req]


#: (sequence length, query rows) of the requests :func:`pieces_are_exact` checks, each beside a decode row and a
#: prefill chunk: short and long sequences, the 128-token cache block's edges, up to a 33-row verify.
PIECE_PROBES = tuple((t, q) for t in (5, 127, 129, 700, 2100) for q in (2, 11, 33) if q <= t)


def _attend(requests: list[tuple[int, int, int]], q_all: list[torch.Tensor], key_cache: torch.Tensor,
            value_cache: torch.Tensor, tables: list[torch.Tensor], shape: tuple[int, int, int], isa: str, rows: int,
            window: int) -> list[torch.Tensor]:
    """vLLM's CPU attention kernel on ``requests`` ((which, query rows, sequence length) each), split into pieces of
    ``rows`` as exact mode splits them; each request's output rows."""
    load_vllm_ops()
    heads, kv_heads, head_dim = shape
    q = torch.cat([q_all[r][t - n:t] for r, n, t in requests])
    qsl = torch.tensor([0, *itertools.accumulate(n for _, n, _ in requests)], dtype=torch.int32)
    seq = torch.tensor([t for _, _, t in requests], dtype=torch.int32)
    table = torch.stack([tables[r] for r, _, _ in requests])
    split = split_queries(qsl, seq, table, rows)
    if split is not None:
        qsl, seq, table = split
    # (the ops as vLLM's cpu_attn backend calls them, through vllm._custom_ops' wrappers of the same names)
    meta = torch.ops._C.get_scheduler_metadata(len(seq), heads, kv_heads, head_dim, seq, q.dtype, qsl, True, window,
                                               isa, False, None, "auto")
    out = torch.empty_like(q)
    torch.ops._C.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, qsl, seq, head_dim ** -0.5, True, None,
                                             window, table, 0.0, meta, None, None, 1.0, 1.0, "auto")
    return list(out.split([n for _, n, _ in requests]))


def pieces_are_exact(isa: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, rows: int,
                     window: int = -1, block_size: int = 128) -> bool:
    """Whether vLLM's CPU attention kernel gives every query row of :data:`PIECE_PROBES`' requests, sent in pieces
    of ``rows`` beside other requests (a decode row, a prefill chunk), bit for bit the row's one-token step (random
    queries, keys and values of this head shape; ``window``: a sliding window, -1 none)."""
    gen = torch.Generator().manual_seed(0)
    longest = max(t for t, _ in PIECE_PROBES)
    blocks = -(-longest // block_size)
    cache = [torch.randn(3 * blocks, kv_heads, block_size, head_dim, generator=gen).to(dtype) for _ in range(2)]
    tables = [torch.arange(r * blocks, (r + 1) * blocks, dtype=torch.int32) for r in range(3)]
    q_all = [torch.randn(longest, heads, head_dim, generator=gen).to(dtype) for _ in range(3)]
    shape = (heads, kv_heads, head_dim)
    with torch.inference_mode():
        for t, n in PIECE_PROBES:
            beside = _attend([(1, 1, 900), (0, n, t), (2, 200, 600)], q_all, *cache, tables, shape, isa, rows, window)
            if not rows_agree(lambda i, _: _attend([(0, 1, t - n + i + 1)], q_all, *cache, tables, shape, isa, rows,
                                                   window)[0], beside[1], ((i, 1) for i in range(n))):
                return False
    return True


def wrap_attention_build(original: Any) -> Any:
    """Patch 5 (:mod:`rag_accel.vllm.patches` applies it): a request's query rows as pieces in an exact engine."""
    def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        rows = getattr(self, "_rag_accel_rows", None)
        if rows is None:
            engine_mode = mode(self.vllm_config)
            if not active(engine_mode, self.dtype):
                rows = self._rag_accel_rows = 0
            else:
                from vllm import envs

                # one sequence's keys never split across threads (summed in another order): vLLM's setting, read
                # by the builder at each step, in this worker only (a declared patch: patches.INTERNALS)
                envs.VLLM_CPU_ATTN_SPLIT_KV = False
                rows = piece_rows(self.isa, self.num_heads, self.num_kv_heads)
                window = getattr(self, "window_size", -1)
                shape = (self.isa, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)
                if rows > 1 and not pieces_are_exact(*shape, rows, window, self.block_size):
                    log.warning("rag_accel: vLLM's CPU attention kernel (%s) does not reduce %d-row pieces as "
                                "one-token steps here; exact steps send every query row alone", shape, rows)
                    rows = 1
                self._rag_accel_rows = rows
                _STATUS["attention"] += 1
                log.info("rag_accel: exact steps (%s): %d linear layers in invariant chunks, attention in pieces "
                         "of %d query rows (%s, %s)", engine_mode, _STATUS["linears"], rows, self.isa,
                         str(self.dtype).replace("torch.", ""))
        if not rows:
            return original(self, common_prefix_len, cm, fast_build)
        n = cm.num_reqs
        split = split_queries(cm.query_start_loc_cpu[:n + 1], cm.seq_lens[:n], cm.block_table_tensor[:n], rows)
        if split is not None:
            qsl, seq, table = split
            cm = dataclasses.replace(cm, query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq,
                                     num_reqs=len(seq), max_query_len=min(rows, cm.max_query_len),
                                     block_table_tensor=table)
        return original(self, common_prefix_len, cm, fast_build)

    build.__wrapped__ = original  # type: ignore[attr-defined]
    return build
