"""The output projection on a CPU, as one GEMM in the layout MKL runs fast.

A decoding step multiplies 1 to ~33 hidden rows by the output embedding
(SmolLM2: 49152 x 576, 113 MB in float32, read from memory every step).
``hidden @ weight.T`` with that few rows runs at a third to a half of the memory
speed on this CPU (MKL's one-row GEMV, and its few-row GEMM on a transposed
operand), while ``weight @ hidden.T`` with at least two rows streams the weight
once: 7.3 ms -> 2.7 ms for one or two rows, 23 ms -> 3.3 ms for three, measured
in isolation; a whole SmolLM2 step at 600 cached tokens went from 44 to 39 ms
(one token) and from 72 to 58 ms (a two-token verify).

The override replaces ``forward`` of the model's output-embedding module (a
plain ``nn.Linear`` without bias, float32 on a CPU; anything else is left alone)
with a wrapper that takes the fast path only inside :func:`transposed_head`, a
context variable set by the decoder around its own forwards, so other callers
of the same model and other threads compute exactly what they did before. The
logits differ from the original layout only by float rounding, as a verify
step's do from one-token steps; the exactness tests hold the decoder to
``generate``'s token ids.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Any

import torch

from .._context import scoped

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("rag_accel_transposed_head", default=False)
MAX_ROWS = 16  # measured faster up to here; a 17-row step was level


def transposed_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` computed as ``(weight @ hidden.T).T`` (one row is doubled:
    a two-row GEMM beats the one-row GEMV)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    n = rows.shape[0]
    if n == 1:
        rows = torch.cat([rows, rows])
    out = (weight @ rows.t()).t()[:n]
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """``forward`` of a wrapped output projection: the fast layout inside :func:`transposed_head`."""
    w = self.weight
    if (_ACTIVE.get() and w.device.type == "cpu" and w.dtype == torch.float32 and hidden.dtype == torch.float32
            and not torch.is_grad_enabled() and hidden.numel() // hidden.shape[-1] <= MAX_ROWS):
        return transposed_linear(hidden, w)
    return torch.nn.Linear.forward(self, hidden)


def install(model: Any) -> bool:
    """Wrap the output projection of ``model`` (idempotent). Returns whether it applies.

    The wrapper is a method bound to the module, so ``copy.deepcopy`` and pickling
    of the model carry it over to the copy's own weight."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    if "forward" not in vars(head):
        head.forward = types.MethodType(forward, head)
    return True


def transposed_head(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this block (this thread / context only) wrapped output projections take the fast layout."""
    return scoped(_ACTIVE, enabled)
