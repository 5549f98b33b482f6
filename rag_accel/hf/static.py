"""Steps on a static KV cache, in a few sizes, replayed as CUDA graphs on a GPU.

On a GPU a small model's step is mostly the host launching kernels: SmolLM2's eager step costs about 24 ms where
the same step captured in a CUDA graph costs 3. A graph replays fixed tensors, so here the decoder's steps run on
one preallocated KV cache (transformers' ``StaticCache``, whose length lives on the device) and in a few sizes
(:func:`step_sizes`: 1, 2, 4, 8, ... draft tokens + 1): a verify of ``n`` tokens runs in the smallest size that holds
it, padded with copies of its last token. The padding rows come after the real ones, so causal attention keeps them
out of every real row; what they write to the cache lies past the tokens kept and the next step overwrites it.

Each size is captured once per process and model, at the first step that needs it (a one-line message), then
checked: one replay against the same step run eagerly, argmax for argmax. A capture that fails, or a replay that
differs, leaves the steps eager on the same static cache, with a warning. On a CPU the steps run eagerly (nothing
to capture); ``ReferenceDecoder(static_steps=True)`` takes this path there, as the tests do.

One static cache serves one request at a time (:meth:`StaticSteps.lease`); a request that finds it busy, or that
could outgrow it (:data:`STATIC_CACHE_TOKENS`), runs on a dynamic cache as on a CPU.

Exact steps (``ReferenceDecoder(exact=True)``) come from the fixed shapes: a library's kernels pick their blocking,
split and order of additions by the shapes of a call, and here every step of a size has the same shapes (the cache's
length included), so a row's bits can depend only on its size, its place among the rows and the rows beside it. At
the first request :func:`exact_sizes` finds, on the machine's own kernels (the graphs' replays on a GPU), the sizes
whose rows are bit for bit the largest size's, at every place and beside any rows; the steps then run in those
sizes only (the largest at worst: every step, a plain one too, computes as many rows), so drafting on computes
what drafting off computes. A largest size whose rows depend on their place is dropped (:meth:`StaticSteps.probe`).
"""

from __future__ import annotations

import inspect
import math
import threading
import warnings
from typing import Any

import torch

from ..invariant import PROBE_TRIALS, big_power_of_two, cancelling_rows, rows_agree

#: The static cache's length: a request whose prompt, answer and largest step could pass it runs on a dynamic cache.
STATIC_CACHE_TOKENS = 4096
#: Cache lengths (random tokens) on top of which :func:`exact_sizes` compares the sizes' rows.
PROBE_CONTEXTS = (5, 130, 600)


def step_sizes(max_draft: int) -> tuple[int, ...]:
    """The step sizes for drafts of up to ``max_draft`` tokens: powers of two below ``max_draft + 1``, and it."""
    top = max_draft + 1
    sizes = [1]
    while sizes[-1] * 2 < top:
        sizes.append(sizes[-1] * 2)
    return (*sizes, top) if top > 1 else (1,)


def size_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size that holds ``n`` tokens (``None``: none does)."""
    return next((s for s in sizes if s >= n), None)


def unsupported(model: Any) -> str | None:
    """Why ``model`` cannot take static steps (``None``: it can)."""
    try:
        from transformers import StaticCache
    except ImportError:  # pragma: no cover - every transformers this project supports has it
        return "this transformers has no StaticCache"
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "sliding_window", None) and (not layer_types or any("sliding" in t for t in layer_types)):
        # (a static window is a ring: a rejected draft that pushed a token out of it could not be rolled back)
        return "its sliding-window layers keep a ring of their window that a rejected draft cannot be rolled back in"
    if any(t != "full_attention" for t in layer_types):
        return f"its layers are not all full attention ({sorted(set(layer_types))})"
    del StaticCache
    return None


class StaticSteps:
    """One static KV cache of ``capacity`` tokens for ``model`` and its steps of ``sizes`` tokens (``capture``:
    as CUDA graphs). ``cache_kwarg``: the name under which the model's forward takes its cache."""

    def __init__(self, model: Any, cache_kwarg: str, sizes: tuple[int, ...], capacity: int, capture: bool,
                 exact: bool = False) -> None:
        self.model, self.cache_kwarg, self.sizes, self.capacity = model, cache_kwarg, sizes, capacity
        self.capture = capture  # False once a capture failed: eager steps from then on
        self.unprobed = exact  # exact steps: the sizes are the ones exact_sizes keeps, found at the first lease
        self.closed = False  # no size was exact: no lease from now on
        self.cache: Any = None  # made at the first lease
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # size -> (graph, ids, logits)
        self._busy = threading.Lock()
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def lease(self, need: int) -> StaticLease | None:
        """The static cache for one request of at most ``need`` positions (steps' padding included); ``None``
        where another request holds it, ``need`` is more than it holds, or it is closed."""
        if self.closed or need > self.capacity or not self._busy.acquire(blocking=False):
            return None
        if self.cache is None:
            from transformers import StaticCache

            self.cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        return StaticLease(self)

    def probe(self) -> bool:
        """Exact steps: keep the sizes that compute every row as the largest does (:func:`exact_sizes`, on the cache
        as it stands, which it leaves as it was; the caller holds a lease). Where the largest size's rows depend on
        their place (as where a kernel splits the rows into blocks of fewer), it is dropped and the next one down
        tried: a step then verifies at most that size less one draft tokens. ``False``: no size of two tokens or
        more is exact: the static cache is closed, and every request runs on a dynamic cache, with a warning."""
        from ..models import announced

        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        kept: tuple[int, ...] = ()
        with announced(f"finding which of {name}'s step sizes ({', '.join(map(str, self.sizes))}) compute rows bit "
                       "for bit alike ..."):
            while not kept and self.sizes[-1] >= 2:
                kept = exact_sizes(self)
                if not kept:
                    self.sizes = self.sizes[:-1]
        self.unprobed = False
        if not kept:
            self.closed = True
            warnings.warn("no step size computes its rows bit for bit as the largest does on this machine: exact "
                          "steps run on a dynamic cache, row by row (the same outputs, slower)", stacklevel=4)
            return False
        self.sizes = kept
        return True

    def run(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """The model's forward over ``ids`` [1, S] on the static cache, eagerly: logits [1, S or 1, V]."""
        kwargs: dict[str, Any] = {self.cache_kwarg: self.cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(input_ids=ids, **kwargs).logits

    def step(self, ids: list[int], size: int) -> torch.Tensor:
        """``ids`` padded to ``size`` on top of the cache: logits [size, V] (a graph's replay where one is captured,
        else the eager forward)."""
        padded = ids + [ids[-1]] * (size - len(ids))
        if self.capture and size not in self.graphs:
            self._capture()
        if size in self.graphs:
            graph, buf, out = self.graphs[size]
            buf.copy_(torch.tensor([padded], dtype=torch.long), non_blocking=True)
            graph.replay()
            return out[0]
        device = next(self.model.parameters()).device
        return self.run(torch.tensor([padded], dtype=torch.long, device=device))[0]

    def _capture(self) -> None:
        """Capture a graph per size on the cache as it stands (it is left as it was), check each against its eager
        step; on any failure warn and stay eager."""
        from ..models import announced

        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        try:
            with announced(f"capturing {name}'s steps as CUDA graphs (sizes {', '.join(map(str, self.sizes))}) ..."):
                self.graphs = _capture_graphs(self)
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves eager steps, said once
            self.graphs, self.capture = {}, False
            warnings.warn(f"could not capture the steps as CUDA graphs ({type(e).__name__}: {e}); they run eagerly "
                          "on the static cache (the same outputs, slower)", stacklevel=4)


def _capture_graphs(steps: StaticSteps) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
    """Warm each size up on a side stream, capture it into one memory pool, then check one replay per size against
    the eager step on the same cache (argmax for argmax; ``RuntimeError`` where one differs)."""
    device = next(steps.model.parameters()).device
    cache = steps.cache
    graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
    bufs = {s: torch.zeros(1, s, dtype=torch.long, device=device) for s in steps.sizes}
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            for s in steps.sizes:
                steps.run(bufs[s])
                cache.crop(-s)
    torch.cuda.current_stream(device).wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    for s in steps.sizes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = steps.run(bufs[s])
        graphs[s] = (graph, bufs[s], out)
    vocab = int(out.shape[-1])
    for s, (graph, buf, out) in graphs.items():
        buf.copy_(torch.randint(0, vocab, (1, s), device=device))
        eager = steps.run(buf).argmax(-1)
        cache.crop(-s)
        graph.replay()
        cache.crop(-s)
        if not torch.equal(out.argmax(-1), eager):
            raise RuntimeError(f"a replay of the {s}-token step differs from the eager step")
    return graphs


def exact_sizes(steps: StaticSteps, contexts: tuple[int, ...] = PROBE_CONTEXTS) -> tuple[int, ...]:
    """The sizes of ``steps`` whose rows are bit for bit the largest size's, in two probes:

    1. every projection of the model (one per weight shape, as its forward runs now): :func:`linear_sizes`;
    2. the whole model, attention included, on the sizes the first kept: on top of random contexts of each of
       ``contexts`` tokens, the largest size's step over random tokens gives each token's reference logits; a size
       ``s`` is kept where the same tokens give the same logits run one per step (each at the first row of an
       ``s``-token step, the rest padding: a plain step) and ``s`` per step (at every row, beside other tokens).
       The largest size run one token per step tests that its rows do not depend on their place.

    (A product whose order of additions changes with the rows changes a bfloat16 result only where its rounding
    flips: a few logits of a small vocabulary can all come out equal, so the projections are probed alone first, on
    every output of :data:`~rag_accel.invariant.PROBE_TRIALS` random inputs.) The cache is left as it was found;
    an empty answer: no size is exact."""
    top, device = steps.sizes[-1], next(steps.model.parameters()).device
    vocab = int(steps.model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    kept = [s for s in steps.sizes if s in linear_sizes(steps.model, steps.sizes)]
    if kept and kept[-1] == top:
        kept = [s for s in kept if s in attention_sizes(steps, tuple(kept))]
    if not kept or kept[-1] != top:
        return ()

    def chain(tokens: list[int], group: int, size: int) -> torch.Tensor:  # logits [len(tokens), V]
        rows = []
        for i in range(0, len(tokens), group):
            part = tokens[i:i + group]
            rows.append(steps.step(part, size)[:len(part)].clone())  # (a replay's output is overwritten next)
            if size > len(part):
                steps.cache.crop(-(size - len(part)))  # the padding's positions, as a lease's step drops them
        steps.cache.crop(-len(tokens))
        return torch.cat(rows)

    with torch.inference_mode():
        for n in contexts:
            n = max(1, min(n, steps.capacity - 2 * top))
            context = torch.randint(0, vocab, (1, n), generator=gen).to(device)
            tokens = torch.randint(0, vocab, (top,), generator=gen).tolist()
            steps.run(context, last_only=True)
            try:
                reference = chain(tokens, top, top)
                for s in list(kept):
                    if any(not rows_agree(lambda _, n: chain(tokens, group, s), reference, [(0, top)])
                           for group in {1, s} - {top}):
                        kept.remove(s)
            finally:
                steps.cache.crop(-n)
    return tuple(kept)


def linear_sizes(model: Any, sizes: tuple[int, ...], trials: int = PROBE_TRIALS) -> set[int]:
    """The ``sizes`` at which every projection of ``model`` (``nn.Linear`` and transformers' ``Conv1D``, one module
    per weight shape, called as the model calls it: ``[1, rows, in]``) computes each row bit for bit as it does
    among the largest size's rows, at the start and at the end of them, on ``trials`` inputs of
    :func:`cancelling_rows`; none where the largest size's rows change with their place."""
    top = sizes[-1]
    kept, seen = set(sizes), set()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for module in model.modules():
            conv1d = type(module).__name__ == "Conv1D"  # (GPT-2's: its weight is [in, out])
            if not (isinstance(module, torch.nn.Linear) or conv1d):
                continue
            weight = module.weight
            key = (tuple(weight.shape), weight.dtype, conv1d, getattr(module, "bias", None) is not None)
            if key in seen:
                continue
            seen.add(key)
            for _ in range(trials):
                x = cancelling_rows(top, weight.t() if conv1d else weight, gen)
                x = x.to(device=weight.device, dtype=weight.dtype)[None]  # [1, top, in]
                ref = module(x)[0]  # [top, out]
                if not rows_agree(lambda _, n: module(x.roll(1, 1))[0].roll(-1, 0), ref, [(0, top)]):
                    return set()  # (a row's bits depend on its place among the rows)
                for s in sorted(kept - {top}):
                    if not rows_agree(lambda o, n: module(x[:, o:o + n])[0], ref, ((o, s) for o in {0, top - s})):
                        kept.discard(s)
    return kept


def attention_sizes(steps: StaticSteps, sizes: tuple[int, ...], trials: int = PROBE_TRIALS) -> set[int]:
    """The ``sizes`` at which the model's attention computes each query row bit for bit as among the largest size's
    rows. The call is the model's own: one largest-size step runs with ``scaled_dot_product_attention`` recorded
    on top of a cached context (its first layer's arguments: the whole static cache's keys, the step's mask), then
    the same call runs on
    probe values in every size: random queries and keys, two keys alike whose values are big and opposite
    (they cancel exactly, so the order in which the values are summed shows), small random values
    elsewhere; the largest size with its rows rolled by one tests that a row's place changes nothing (none kept
    where it does). All sizes where the call takes no mask (nothing recorded to replay)."""
    import torch.nn.functional as F

    top = sizes[-1]
    calls: list[tuple[tuple, dict]] = []
    original = F.scaled_dot_product_attention

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    device = next(steps.model.parameters()).device
    n = max(2, min(PROBE_CONTEXTS[1], steps.capacity - 2 * top))  # (cached keys every query row sees)
    with torch.inference_mode():
        steps.run(torch.zeros(1, n, dtype=torch.long, device=device), last_only=True)
        F.scaled_dot_product_attention = record
        try:
            steps.run(torch.zeros(1, top, dtype=torch.long, device=device))
        finally:
            F.scaled_dot_product_attention = original
            steps.cache.crop(-(n + top))
    if not calls:
        return set(sizes)
    (q, k, v, *rest), kwargs = calls[0]
    mask = kwargs.pop("attn_mask", rest[0] if rest else None)
    if mask is None or q.shape[-2] != top:
        return set(sizes)
    allowed = mask[0, 0, 0] if mask.dtype == torch.bool else mask[0, 0, 0] == 0  # keys the first row sees
    seen = torch.nonzero(allowed.cpu()).flatten()
    kept = set(sizes)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(trials if len(seen) >= 2 else 0):
            qp, kp, vp = (torch.randn(t.shape, generator=gen) for t in (q, k, v))
            a, b = seen[torch.randperm(len(seen), generator=gen)[:2]].tolist()
            kp[:, :, b] = kp[:, :, a]
            big = big_power_of_two(q.dtype, 1.0) * math.sqrt(len(seen))  # (weights ~1/len(seen), values ~1)
            vp[:, :, a], vp[:, :, b] = big, -big
            qp, kp, vp = (t.to(device=q.device, dtype=q.dtype) for t in (qp, kp, vp))
            ref = original(qp, kp, vp, attn_mask=mask, **kwargs)  # [1, H, top, D]
            rolled = original(qp.roll(1, 2), kp, vp, attn_mask=mask.roll(1, 2), **kwargs).roll(-1, 2)
            if not rows_agree(lambda _, n: rolled, ref, [(0, top)], dim=2):
                return set()  # (a row's bits depend on its place among the rows)
            for s in sorted(kept - {top}):
                if not rows_agree(lambda o, n: original(qp[:, :, o:o + n], kp, vp, attn_mask=mask[:, :, o:o + n],
                                                        **kwargs), ref, ((o, s) for o in {0, top - s}), dim=2):
                    kept.discard(s)
    return kept


class StaticLease:
    """A request's hold on the static cache: the KV cache the decoder's steps and
    :func:`~rag_accel.hf.kv.rollback_cache` take. :meth:`release` hands it back (the next request starts from an
    empty cache)."""

    def __init__(self, steps: StaticSteps) -> None:
        self.steps = steps
        self.length = 0  # tokens cached
        self._released = False

    def forward(self, ids: list[int], last_only: bool, device: torch.device) -> torch.Tensor:
        """Logits over ``ids`` on top of the cache: ``[len(ids), V]`` (``last_only``: the last row's). A prompt
        (``last_only``, or longer than the largest size) runs eagerly and unpadded; a step in its size."""
        size = None if last_only else size_for(len(ids), self.steps.sizes)
        if size is None:
            logits = self.steps.run(torch.tensor([ids], dtype=torch.long, device=device), last_only)[0]
            self.length += len(ids)
            return logits
        logits = self.steps.step(ids, size)
        self.length += size
        if size > len(ids):
            self.crop(-(size - len(ids)))  # the padding's positions: the next step writes over them
        return logits[:len(ids)]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' ``crop`` convention: a negative count)."""
        n = -tokens_to_remove
        if n < 0 or n > self.length:
            raise ValueError(f"cannot remove {n} of {self.length} cached tokens")
        if n:
            self.steps.cache.crop(-n)
            self.length -= n

    def get_seq_length(self) -> int:
        return self.length

    def release(self) -> None:
        """Empty the cache and hand it back (once; later calls do nothing)."""
        if self._released:
            return
        self._released = True
        try:
            if self.length:
                with torch.inference_mode():  # (the cache's tensors are inference tensors)
                    self.steps.cache.crop(-self.length)
                self.length = 0
        finally:
            self.steps._busy.release()


def release(cache: Any) -> None:
    """Hand a request's cache back where it is a lease of the static cache (a dynamic cache is just dropped)."""
    if isinstance(cache, StaticLease):
        cache.release()


def resolve(model: Any, static_steps: bool | None, exact: bool, cache_kwarg: str, max_draft: int,
            context_window: int | None) -> StaticSteps | None:
    """The decoder's static steps: ``None`` (the default) takes them on a GPU where the model can; ``True`` asks for
    them anywhere (on a CPU, eagerly) and is refused where they cannot run; ``False``: never. ``exact``: steps in
    the sizes :func:`exact_sizes` keeps (found at the first request)."""
    if static_steps is not None and not isinstance(static_steps, bool):
        raise TypeError(f"static_steps must be a bool or None, got {type(static_steps).__name__}")
    device = next(model.parameters()).device
    if static_steps is False or (static_steps is None and device.type != "cuda"):
        return None
    why = unsupported(model)
    if why is not None:
        if static_steps:
            raise ValueError(f"static_steps=True cannot run on this model: {why}; leave static_steps unset")
        warnings.warn(f"the steps run eagerly on a dynamic cache, not as CUDA graphs: {why}", stacklevel=3)
        return None
    capacity = STATIC_CACHE_TOKENS if context_window is None else min(STATIC_CACHE_TOKENS, context_window)
    return StaticSteps(model, cache_kwarg, step_sizes(max_draft), capacity, capture=device.type == "cuda",
                       exact=exact)
