"""What a decoder measures about its machine at load, remembered for the next process on the same machine.

At load the transformers decoder times its projections' layouts (:func:`rag_accel.hf.linears.plan_linears`), finds
invariant plans for exact steps (:func:`~rag_accel.hf.linears.exact_plans`), probes the attention kernel
(:func:`rag_accel.hf.attention.block_is_invariant`) and times a verify of 1..``max_draft_tokens`` tokens (the cost
curve): seconds for a small model, tens of seconds on a busy CPU. None of it changes between processes on the same
machine, so it is kept in one JSON file under ``$RAG_ACCEL_HOME/calibration/``, keyed by everything that changes it:
the model (its folder, its config and its weight files' sizes and times), the dtype and device, the CPU (its model
name and its vector and matrix units), torch's thread count, and the versions of torch, transformers and this
format. A later process with the same key reads the file instead of measuring.

Never trusted blindly: a file that does not parse, holds another key, or whose values are not what a measurement
gives (shapes, plans, curves) is set aside with a warning and measured again, then overwritten. The file is written
whole (a temporary file renamed), so two processes calibrating at once leave one valid file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..invariant import ExactPlan
from ..machine import cpu_identity  # (re-exported: a calibration's key names the CPU)
from .linears import LinearPlan

__all__ = ["Calibration", "cpu_identity", "model_identity"]

#: The format (and the measurements' method): a change makes every stored calibration another key's. (2: exact plans
#: cover Conv1D projections; the attention probe draws each case three times.)
VERSION = 2


def model_identity(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A model folder as its calibration depends on it: its path, its config and its weight files (name, size,
    time); ``None`` for anything that is not a folder holding a config (a hub name: not remembered)."""
    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        return None
    weights = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in folder.iterdir()
                     if f.suffix in (".safetensors", ".bin", ".pt"))
    return {"path": str(folder.resolve()), "config": hashlib.sha256(config.read_bytes()).hexdigest(),
            "weights": weights}


def _key(model: dict[str, Any], dtype: torch.dtype, device: torch.device, draft: dict[str, Any] | None) -> dict:
    import transformers

    key = {"version": VERSION, "model": model, "draft_model": draft, "dtype": str(dtype), "device": device.type,
           "cpu": cpu_identity(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": sys.version.split()[0]}
    return json.loads(json.dumps(key))  # (as a file holds it: tuples as lists)


class Calibration:
    """One decoder's remembered measurements (see the module). ``get`` gives a section only as measured values;
    ``put`` stores one and writes the file."""

    def __init__(self, path: Path, key: dict[str, Any], sections: dict[str, Any] | None = None) -> None:
        self.path, self.key, self.sections = path, key, dict(sections or {})

    @classmethod
    def open(cls, model_path: str | os.PathLike[str], dtype: torch.dtype, device: torch.device,
             draft_path: str | os.PathLike[str] | None = None, home: Path | None = None) -> Calibration | None:
        """The calibration of this model on this machine (read where a valid file has it, else empty); ``None``
        where the model (or its draft model) is not a local folder."""
        from ..models import announce, cache_home

        model = model_identity(model_path)
        draft = model_identity(draft_path) if draft_path is not None else None
        if model is None or (draft_path is not None and draft is None):
            return None
        key = _key(model, dtype, device, draft)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = (home or cache_home() / "calibration") / f"{digest}.json"
        if not path.is_file():
            return cls(path, key)
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key or not isinstance(data.get("sections"), dict):
                raise ValueError("it holds another key")
            sections = {name: _READERS[name](value) for name, value in data["sections"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            announce(f"the calibration in {path} is damaged ({e}); measuring again")
            return cls(path, key)
        return cls(path, key, sections)

    def get(self, section: str) -> Any:
        return self.sections.get(section)

    def put(self, section: str, value: Any) -> None:
        self.sections[section] = value
        data = {"key": self.key, "sections": {name: _WRITERS[name](v) for name, v in self.sections.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:  # a read-only home: the next process measures again, nothing else changes
            tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- sections, checked on reading
def _shape(value: Any) -> tuple[int, int, torch.dtype]:
    n, k, dtype = value
    dt = getattr(torch, str(dtype).replace("torch.", ""))
    if not (isinstance(n, int) and isinstance(k, int) and n > 0 and k > 0 and isinstance(dt, torch.dtype)):
        raise ValueError(f"bad weight shape {value!r}")
    return n, k, dt


def _read_linear(value: Any) -> dict:
    out = {}
    for shape, rows, transposed in value:
        if len(rows) != len(transposed) or not all(isinstance(r, int) and r >= 0 for r in rows):
            raise ValueError(f"bad linear plan {rows!r}")
        out[_shape(shape)] = LinearPlan(tuple(rows), tuple(bool(t) for t in transposed))
    return out


def _read_exact(value: Any) -> dict:
    out = {}
    for shape, chunk, transposed, pad in value:
        if not (isinstance(chunk, int) and chunk >= 1 and isinstance(pad, int) and pad >= 1):
            raise ValueError(f"bad exact plan {chunk!r}, {pad!r}")
        out[_shape(shape)] = ExactPlan(chunk, bool(transposed), pad)
    return out


def _read_curves(value: Any) -> dict:
    out = {}
    for key, curve in value:
        max_draft, *flags = key
        if (len(curve) != max_draft + 1 or curve[0] != 1.0
                or any(not 1.0 <= b < 1e3 or b < a for a, b in zip(curve, curve[1:]))):
            raise ValueError(f"bad cost curve {curve!r}")
        out[(int(max_draft), *(bool(f) for f in flags))] = tuple(float(c) for c in curve)
    return out


def _read_verdicts(value: Any) -> dict:
    return {(int(h), int(kv), int(d), _shape([1, 1, dt])[2], str(dev), int(t)): bool(ok)
            for (h, kv, d, dt, dev, t), ok in value}


_READERS = {"linear_plans": _read_linear, "exact_plans": _read_exact, "cost_curves": _read_curves,
            "attention": _read_verdicts}
_WRITERS = {
    "linear_plans": lambda d: [[[n, k, str(dt)], list(p.rows), list(p.transposed)] for (n, k, dt), p in d.items()],
    "exact_plans": lambda d: [[[n, k, str(dt)], p.chunk, p.transposed, p.pad] for (n, k, dt), p in d.items()],
    "cost_curves": lambda d: [[list(k), list(c)] for k, c in d.items()],
    "attention": lambda d: [[[h, kv, dim, str(dt), dev, t], ok] for (h, kv, dim, dt, dev, t), ok in d.items()],
}
