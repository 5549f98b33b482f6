"""Grouped-query attention for verification forwards, without copying the cache, and exact attention.

With several query tokens and a mask, transformers' SDPA path expands every layer's cached keys and values to all
query heads (``repeat_kv``) before the kernel: on a CPU, at ~1000 cached tokens, most of a verify step's attention
time. Inside :func:`packed_gqa` (a context variable: other threads and callers of the model are untouched) the
decoder's multi-token forwards instead ask the CPU kernel to group the heads (``enable_gqa``), or on CUDA pack the
query heads that share a key/value head into the query-length dimension: the same dot products, no copy. Anything
but the plain case (one query token, no mask, dropout, sinks, soft-capping, position bias, paged caches) goes to
the original function unchanged.

Exact steps compute each query row as a one-token step computes it, in one of two ways: :func:`block_attention`,
one kernel call for all rows with the keys padded with masked zeros to a multiple of the kernel's key block, so
that every row is reduced over the same blocks, taken for a head shape and dtype only where
:func:`block_is_invariant` finds it bit-exact on this machine's kernel; else :func:`row_attention`, one call per
row, invariant by construction (sliding-window layers always). What the verdicts were on this project's CPUs and
what the block path saves: ``benchmarks/results/verify_costs_cpu_exact_bf16_block.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch

from .._context import scoped
from ..invariant import VERDICTS, rows_agree

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("rag_accel_packed_gqa", default=False)
_EXACT: contextvars.ContextVar[bool] = contextvars.ContextVar("rag_accel_exact_attention", default=False)
_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
_ORIGINAL: Callable[..., Any] | None = None
# kwargs that change the computation: with any of them set, the original function runs
_SPECIAL = ("softcap", "s_aux", "position_bias", "cache", "sinks")


def pack_gqa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None,
    kernel_gqa: bool | None = None,
) -> torch.Tensor:
    """Attention of ``query`` [B, H, Q, D] over ``key``/``value`` [B, Hkv, K, D]
    (H a multiple of Hkv, head ``h`` reading key/value head ``h // (H // Hkv)``)
    under ``mask`` [B or 1, 1 or H, Q, K]; returns [B, Q, H, D] like transformers'
    attention functions. ``kernel_gqa``: let the kernel group the heads (default:
    on a CPU) instead of packing them."""
    b, h, q, d = query.shape
    if kernel_gqa is None:
        kernel_gqa = query.device.type == "cpu" and _HAS_ENABLE_GQA
    if kernel_gqa:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    hkv = key.shape[1]
    rep = h // hkv
    packed = query.reshape(b, hkv, rep * q, d)  # rows of one key/value head: its rep query heads, Q each
    if mask.shape[1] == 1:
        mask = mask.repeat(1, 1, rep, 1)  # [B, 1, rep*Q, K]: every query head sees the same rows
    else:
        mask = mask.reshape(mask.shape[0], hkv, rep * q, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous()


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                  window: int | None = None) -> torch.Tensor:
    """Attention of each of ``query``'s ``Q`` rows [B, H, Q, D] over the keys before it and its own (the last ``Q``
    of ``key``/``value`` [B, Hkv, T, D] are the rows' own, in order; ``window``: a sliding window of that many keys),
    each row as ONE query of its own, exactly as a one-token step computes it: the query heads of a key/value head
    packed as its queries (transformers' layout for one token), over exactly the keys that row sees, no mask. So
    row ``i``'s values are bit for bit a one-token step's at its position, whatever ``Q``. Returns [B, Q, H, D].

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
        >>> rows = row_attention(q, k, v, None)
        >>> one = row_attention(q[:, :, 1:2], k[:, :, :6], v[:, :, :6], None)  # row 1 as a one-token step
        >>> torch.equal(rows[:, 1:2], one)
        True
    """
    b, h, q_len, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    rep = h // hkv
    rows = []
    for i in range(q_len):
        end = t - q_len + i + 1
        start = max(0, end - window) if window else 0
        q = query[:, :, i:i + 1].reshape(b, hkv, rep, d)
        out = torch.nn.functional.scaled_dot_product_attention(q, key[:, :, start:end], value[:, :, start:end],
                                                               scale=scaling)
        rows.append(out.reshape(b, h, 1, d))
    return (rows[0] if q_len == 1 else torch.cat(rows, 2)).transpose(1, 2).contiguous()


#: The key block :func:`block_attention` pads to (torch's CPU flash attention splits keys in blocks of 512 from
#: 512 keys on); :func:`block_is_invariant` checks, per head shape, that it makes rows invariant.
KEY_BLOCK = 512


@functools.lru_cache(maxsize=4)
def _row_limits_mask(q_len: int, rep: int, t: int, padded: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """[rep * q_len, padded]: 0 where row ``(r, i)`` sees key ``j`` (``j < t - q_len + i + 1``), -inf elsewhere.
    Cached (read only): every layer of a step asks for the same one."""
    limits = (t - q_len + 1 + torch.arange(q_len, device=device)).repeat(rep)
    keys = torch.arange(padded, device=device)
    return torch.zeros(rep * q_len, padded, dtype=dtype, device=device).masked_fill_(
        keys[None] >= limits[:, None], float("-inf"))


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                    block: int = KEY_BLOCK) -> torch.Tensor:
    """Attention of ``query``'s ``Q`` rows [B, H, Q, D] over the keys before each and its own (the last ``Q`` of
    ``key``/``value`` [B, Hkv, T, D] are the rows' own), in ONE kernel call: the query heads of a key/value head
    packed as its queries, the keys padded with zeros to a multiple of ``block`` and masked per row. Where the
    kernel reduces keys in blocks of ``block`` (:func:`block_is_invariant` says), a row's values are bit for bit
    the same row's alone, whatever ``Q``. Returns [B, Q, H, D].

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
        >>> mask = torch.ones(3, 7, dtype=torch.bool).tril(4)
        >>> want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        >>> torch.allclose(block_attention(q, k, v, None, block=4), want.transpose(1, 2), atol=1e-5)
        True
    """
    b, h, q_len, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    rep = h // hkv
    padded = -(-t // block) * block
    if padded > t:
        key = torch.nn.functional.pad(key, (0, 0, 0, padded - t))
        value = torch.nn.functional.pad(value, (0, 0, 0, padded - t))
    mask = _row_limits_mask(q_len, rep, t, padded, query.dtype, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, rep * q_len, d), key, value,
                                                           attn_mask=mask[None, None], scale=scaling)
    return out.reshape(b, h, q_len, d).transpose(1, 2).contiguous()


#: (cache length, rows) pairs :func:`block_is_invariant` tries: every row count a verify sends (2 to 33) on one
#: cache, then short and long caches and the key block's edges. (Row counts go in full: in float32 the 1.5B's
#: heads passed 2, 5, 16 and 33 rows and failed 6, 11, 22 and 27, the kernel's query blocks leaving a few-row tail.)
PROBES = tuple((700, q) for q in range(2, 34)) + tuple(
    (t, q) for t in (3, 40, 511, 512, 513, 1100, 2100) for q in (2, 5, 6, 11, 16, 22, 27, 33) if q <= t)
#: Random draws per case: a kernel whose rows depend on their neighbours shows it only where a rounding flips (on
#: an AVX-512 CPU without bfloat16 instructions, 10 of 36 cases of 6, 11, 22 or 27 rows, once each; one draw of the
#: probe's cases passed such a kernel).
PROBE_DRAWS = 3


def block_is_invariant(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether :func:`block_attention` gives every row of every :data:`PROBES` call, bit for bit, the values of
    the same row alone (random queries, keys and values of this head shape, on this machine's kernel at torch's
    current intra-op thread count, by which the kernel splits its work; once per shape, thread count and process:
    about 0.15-0.3 s on a 2-core CPU; an earlier process's verdicts seed :data:`~rag_accel.invariant.VERDICTS`)."""
    key = (heads, kv_heads, head_dim, dtype, device, torch.get_num_threads())
    return VERDICTS.get(VERDICT_KIND, key, lambda: _probe(*key))


#: :data:`~rag_accel.invariant.VERDICTS`' table of :func:`block_is_invariant`: (heads, kv heads, head size, dtype,
#: device, threads) -> its verdict (:mod:`rag_accel.hf.steps` remembers them in the machine's calibration).
VERDICT_KIND = "block attention"


def _probe(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, threads: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    for t, q_len in PROBES * PROBE_DRAWS:
        q, k, v = (torch.randn(1, n, length, head_dim, generator=gen).to(device=device, dtype=dtype)
                   for n, length in ((heads, q_len), (kv_heads, t), (kv_heads, t)))
        with torch.inference_mode():
            rows = block_attention(q, k, v, scale)  # [1, Q, H, D]: each row against the same row alone
            alone = [(i, 1) for i in range(q_len)]
            if not rows_agree(lambda i, _: block_attention(q[:, :, i:i + 1], k[:, :, :t - q_len + i + 1],
                                                           v[:, :, :t - q_len + i + 1], scale), rows, alone, dim=1):
                return False
    return True


def exact_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
               window: int | None = None) -> torch.Tensor:
    """An exact step's attention: :func:`block_attention` where this head shape's kernel makes it invariant and
    there is no sliding window, else :func:`row_attention`. Returns [B, Q, H, D]."""
    if not window and block_is_invariant(query.shape[1], key.shape[1], query.shape[3], query.dtype,
                                         query.device.type):
        return block_attention(query, key, value, scaling)
    return row_attention(query, key, value, scaling, window)


def _wrapper(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             **kwargs: Any) -> tuple[torch.Tensor, Any]:
    assert _ORIGINAL is not None
    if _EXACT.get():
        special = [k for k in _SPECIAL if kwargs.get(k) is not None] + (["dropout"] if dropout else [])
        if special or query.shape[1] % key.shape[1]:
            raise ValueError(f"exact steps (ReferenceDecoder(exact=True)) cannot compute this model's attention "
                             f"row by row ({', '.join(special) or 'query heads not a multiple of key heads'}); "
                             "pass exact=False")
        return exact_rows(query, key, value, scaling, getattr(module, "sliding_window", None)), None
    groups = getattr(module, "num_key_value_groups", 1)
    if (not _ACTIVE.get() or query.shape[2] == 1 or groups <= 1 or attention_mask is None or dropout
            or attention_mask.ndim != 4 or query.shape[1] != key.shape[1] * groups
            or any(kwargs.get(k) is not None for k in _SPECIAL) or kwargs.get("output_attentions")):
        return _ORIGINAL(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[2]]
    return pack_gqa_attention(query, key, value, mask, scaling), None


def install() -> bool:
    """Wrap transformers' "sdpa" attention function once (idempotent). False where this
    transformers has no attention registry (then nothing changes)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without the registry
        return False
    original = AttentionInterface._global_mapping.get("sdpa")
    if original is None:  # pragma: no cover
        return False
    _ORIGINAL = original
    AttentionInterface.register("sdpa", _wrapper)
    return True


def packed_gqa(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / task only), multi-token SDPA attention packs GQA heads."""
    return scoped(_ACTIVE, enabled)


def exact_attention(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / task only), SDPA attention computes each row as a one-token step does
    (:func:`exact_rows`)."""
    return scoped(_EXACT, enabled)
