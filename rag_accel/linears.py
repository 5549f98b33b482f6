"""The model's linear layers on a CPU, for few rows, as one GEMM in the layout MKL runs fast.

A decoding step multiplies 1 to ~33 hidden rows by every weight of the model.
With that few rows MKL's ``hidden @ weight.T`` is slow in two places on this
project's CPU (2 cores, float32, torch 2.13.0):

- the output projection (SmolLM2: 49152 x 576, 113 MB, read from memory every
  step) runs at a third to a half of the memory speed for 1 to 16 rows, while
  ``weight @ hidden.T`` with at least two rows streams the weight once:
  7.3 ms -> 2.7 ms for one or two rows, 23 ms -> 3.3 ms for three. A SmolLM2 step
  at 600 cached tokens went from 44 to 39 ms (one token), 72 to 58 ms (two).
- the attention and MLP projections inside the layers (576 x 576 up to
  1536 x 576): a 2-row product costs twice a 1-row one (gate_proj 115 us vs
  52 us) where ``weight @ hidden.T`` costs 74 us; for 2-4 rows the transposed
  layout made a whole step 20-27% cheaper (600 cached tokens: 57 -> 44 ms for a
  2-token verify, 67 -> 48 ms for 3, 59 -> 47 ms for 4), for 5 and more it was
  up to 10% dearer, and for one row the GEMV is best as it is.

The row ranges below are those measurements. :func:`install` replaces ``forward``
of each plain ``nn.Linear`` without bias (the output embedding, and the layers'
projections; anything else is left alone) with a method that takes the fast
layout only inside :func:`transposed_linears`, a context variable set by the
decoder around its own forwards, so other callers of the same model and other
threads compute exactly what they did before. The results differ from the
original layout only by float rounding, as a verify step's do from one-token
steps; the exactness tests hold the decoder to ``generate``'s token ids.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Any

import torch

from ._context import scoped

# (output projection, other linears) take the fast layout; set by the decoder around its forwards
_ACTIVE: contextvars.ContextVar[tuple[bool, bool]] = contextvars.ContextVar("rag_accel_transposed_linears",
                                                                           default=(False, False))
HEAD_ROWS = range(1, 17)  # output projection: faster for 1-16 rows; a 17-row step was level
INNER_ROWS = range(2, 5)  # attention / MLP projections: faster for 2-4 rows; 1 and 5+ are best as they are


def transposed_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` computed as ``(weight @ hidden.T).T`` (one row is doubled:
    a two-row GEMM beats the one-row GEMV)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    n = rows.shape[0]
    if n == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.t()).t()[:n]
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def _fast(weight: torch.Tensor, hidden: torch.Tensor, rows: range) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and hidden.dtype == torch.float32
            and not torch.is_grad_enabled() and hidden.numel() // hidden.shape[-1] in rows)


def head_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a wrapped output projection."""
    if _ACTIVE.get()[0] and _fast(self.weight, hidden, HEAD_ROWS):
        return transposed_linear(hidden, self.weight)
    return torch.nn.Linear.forward(self, hidden)


def inner_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a wrapped linear inside the model's layers."""
    if _ACTIVE.get()[1] and _fast(self.weight, hidden, INNER_ROWS):
        return transposed_linear(hidden, self.weight)
    return torch.nn.Linear.forward(self, hidden)


def _plain(module: Any) -> bool:
    return type(module) is torch.nn.Linear and module.bias is None


def install(model: Any) -> bool:
    """Wrap the plain linears of ``model`` (idempotent; the layers' own only on a CPU in float32).
    Returns whether the output projection is one.

    The wrappers are methods bound to their modules, so ``copy.deepcopy`` and
    pickling of the model carry them over to the copy's own weights."""
    if not isinstance(model, torch.nn.Module):
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if not _plain(module) or "forward" in vars(module):
            continue
        if module is head:
            module.forward = types.MethodType(head_forward, module)
        elif module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            # the layers' projections only where the layout can apply: a GPU model pays no wrapper call
            module.forward = types.MethodType(inner_forward, module)
    return _plain(head)


def transposed_linears(head: bool = True, inner: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / context only) wrapped linears take the fast layout:
    the output projection if ``head``, the layers' projections if ``inner``."""
    return scoped(_ACTIVE, (head, inner))
