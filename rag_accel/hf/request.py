"""One transformers request's state between steps, and its drafting set up on a thread during the prefill."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import DecoderConfig
from ..drafters import Drafter
from ..outputs import GenerationStats
from ..references import ReferenceSetUp
from ..speculation import RequestDrafting
from ..stopping import OutputText
from .sampling import GumbelNoise, Sampling

__all__ = ["RequestState", "SetUp"]


@dataclass
class RequestState:
    """One call's state between steps."""

    context: list[int]  # prompt + output so far
    cache: Any  # the model's KV cache over context[:-1]
    drafting: RequestDrafting  # set up on a thread during the prefill
    out: OutputText
    stats: GenerationStats
    cfg: DecoderConfig
    sampling: Sampling | None
    cost_curve: Sequence[float]
    noise: GumbelNoise | None = None  # sampling only
    warpers: list[Any] = field(default_factory=list)

    def drafting_ready(self) -> None:
        """After the prefill and the set-up: drafting learns the prefill's time (sampling: the draft models share
        the request's noise)."""
        self.drafting.prefill_s = self.stats.prefill_s
        if self.sampling is not None:
            for d in self.drafting.chain.costly:
                d.bind_sampling(self.warpers, self.noise, len(self.context))


class SetUp:
    """A request's drafting set up on a thread of its own, started now: ``prompt_part()``, then its
    references' set-up (:class:`~rag_accel.references.ReferenceSetUp`), if it has one.

    :meth:`wait` waits for the first part, and for the references too when they are small enough to
    be waited for; :meth:`take` hands over their drafters once they are ready, without waiting;
    :meth:`stop` tells the references' set-up that the request needs it no more. What the first part
    raises, :meth:`check` raises; what the references' set-up raises, :meth:`take` raises.
    """

    def __init__(self, prompt_part: Callable[[], None], refs: ReferenceSetUp | None) -> None:
        self.refs = refs
        self.pending = refs is not None  # reference and answers drafters may still come
        self._error: BaseException | None = None
        self._prompt_done = threading.Event()

        def run() -> None:
            try:
                prompt_part()
            except BaseException as e:  # noqa: BLE001 - handed to the decode loop
                self._error = e
                if refs is not None:
                    refs.stop()
            finally:
                self._prompt_done.set()
            if refs is not None:
                refs.run()

        threading.Thread(target=run, name="rag-accel-setup", daemon=True).start()

    def wait(self) -> None:
        """Wait for the drafting over the prompt, and for the references if they are waited for."""
        self._prompt_done.wait()
        if self.refs is not None and self.refs.waited and self._error is None:
            self.refs.wait()

    def take(self) -> list[Drafter]:
        """The reference and answers drafters, once, when they are ready; none before (and after)."""
        if self.refs is None or not self.refs.done:
            return []
        self.pending = False
        return self.refs.take() or []  # (raises what their set-up raised)

    def join(self, drafting: RequestDrafting, order: Any) -> float:
        """The reference and answers drafters join ``drafting`` once they are indexed (``order``: the chain's);
        returns the seconds their set-up took (0 until then and after)."""
        if not self.pending:
            return 0.0
        drafters = self.take()
        for drafter in drafters:
            drafting.add_drafter(drafter, order)
        return self.refs.seconds if drafters else 0.0

    def stop(self) -> None:
        if self.refs is not None:
            self.refs.stop()

    def check(self) -> None:
        """Raise what the drafting over the prompt raised, if it did."""
        if self._error is not None:
            error, self._error = self._error, None
            self.pending = False
            raise error
