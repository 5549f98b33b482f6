"""One request's drafting, shared by the engines: which draft to verify, how much of it, and what it cost.

Every verify step of a request, on any engine, goes through the same verbs:

1. :meth:`RequestDrafting.learn`: the context grew by the tokens the last step
   produced; the drafters index them and every candidate draft learns from them.
2. :meth:`RequestDrafting.choose`: propose candidates, and pick the draft and the
   number of its tokens worth verifying (0: a plain step).
3. (the engine verifies them in one forward pass)
4. :meth:`RequestDrafting.account`: charge what the step really took and how many
   tokens it bought; learn how far the measured cost curve is off.

The Hugging Face decoder (:mod:`rag_accel.hf.decoder`) calls these once per step of
its one request; the vLLM proposer once per row of its batch. What is learnt
across requests lives in :class:`StepCosts` (a batch engine's:
:class:`rag_accel.vllm.costs.BatchStepCosts`) and the policy's
:class:`~rag_accel.policy.AcceptanceStats`, one of each per engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .config import DecoderConfig
from .drafters import NO_DRAFT, Draft, Drafter, DrafterChain, build_drafters
from .policy import STALL, AcceptanceStats, DraftLengthPolicy
from .prediction import REFERENCE_SOURCE

# A draft step is timed against this request's plain-step time only within this many steps of a plain step;
# later in a run of drafted steps its cost is the (learnt) curve's price, and it teaches nothing. Chosen on
# requests simulated as in tests/test_speculation.py (20 seeds x 8 requests, drafts buying 2 tokens for 1.5
# plain steps in runs of 28, on a machine whose step time drifts as a random walk of 10% a step): 32.0 steps a
# request at 1 and 2, as on a steady machine, 34.6 at 4, 50.1 without the rule (20% a step: 32.7, 39.5, 53.4).
# At 1, a verify truly dearer (2.5 plain steps for 2 tokens) took 3 requests to turn drafting off; at 2, 1 or 2.
PLAIN_NEAR = 2


def _within_stall(seconds: float, running: float) -> float:
    """A step's time as a running step time learns from it: within :data:`STALL` times of it either way."""
    return min(max(seconds, running / STALL), STALL * running)


class StepCosts:
    """What steps really cost, learnt across requests from timing them (one per decoder or engine).

    ``scale[b]``: the extra cost of a multi-token verify step beyond a one-token one, observed
    over what the measured curve says, per context-length bucket ``b = len(context).bit_length()``
    (longer contexts make multi-token steps dearer than the one-off measurement).
    ``step_s``: running time of a one-token step. ``draft_token_s`` / ``catchup_token_s``: a
    draft model's time per drafted token, and per context token it catches up on.

    Timings on a user's machine are noisy: other processes stall a step now and then by 2-10x, and
    jitter it by tens of per cent. A draft's extra cost is a fraction of a step (0.5 of one for
    SmolLM2 on a CPU, a few per cent on a GPU), so one step's ``ratio`` magnifies that noise: a
    5x stall of a 1-token draft read as ``(7.5 - 1) / 0.5 = 13`` times the curve, and the old
    running mean jumped from 1 to 2.2 on it. Two stalls priced every draft out, and the scale then
    stayed put (only draft steps teach it), across requests. So each step's ratio is winsorised
    to ``[0, 2 * scale]``, symmetric about the current scale: jitter averages out as before, a
    stall moves the scale by 10% at most, and a real change (long contexts) still gets through,
    at up to 10% a step. ``step_s`` learns from times winsorised to within :data:`STALL` of it.
    """

    def __init__(self, step_s: float | None = None, draft_token_s: float | None = None,
                 catchup_token_s: float | None = None) -> None:
        """The three times may start from a measurement (the transformers decoder's calibration at load), so that a
        fresh engine's first request prices a draft model's tokens and catch-up before it first asks it."""
        self.scale: dict[int, float] = {}
        self.step_s = step_s
        self.draft_token_s = draft_token_s
        self.catchup_token_s = catchup_token_s

    def scale_at(self, context_len: int) -> float:
        return self.scale.get(context_len.bit_length(), 1.0)

    def learn_step(self, policy: DraftLengthPolicy, n_send: int, seconds: float,
                   plain_s: float | None, context_len: int) -> float | None:
        """Learn from one verify step that took ``seconds`` for ``n_send`` draft tokens;
        returns its cost in this request's plain steps (``None`` before a plain step was timed)."""
        step_s = seconds / policy.cost[n_send]  # a one-token step's time, as this step tells it
        self.step_s = step_s if self.step_s is None else 0.9 * self.step_s + 0.1 * _within_stall(step_s, self.step_s)
        if n_send == 0 or plain_s is None or not policy.adaptive:
            return None
        timed_cost = seconds / plain_s
        ratio = (timed_cost - 1.0) / max(policy.base_cost[n_send] - 1.0, 1e-3)
        bucket = context_len.bit_length()
        old = self.scale.get(bucket, 1.0)
        ratio = min(max(ratio, 0.0), 2.0 * old)  # winsorised about the scale: a stall is not the draft's cost
        self.scale[bucket] = min(4.0, max(0.25, 0.9 * old + 0.1 * ratio))
        return timed_cost

    def learn_draft_model(self, drafter: object) -> None:
        """Learn a draft model's cost per drafted token and per caught-up context token."""
        fed = getattr(drafter, "fed", 0)
        if fed > 4:  # a catch-up over many ids: learn its cost per id
            per_id = drafter.sync_s / fed  # type: ignore[attr-defined]
            self.catchup_token_s = per_id if self.catchup_token_s is None else 0.8 * self.catchup_token_s + 0.2 * per_id
        per_token = getattr(drafter, "token_s", None)
        if per_token is not None:
            self.draft_token_s = per_token if self.draft_token_s is None else 0.8 * self.draft_token_s + 0.2 * per_token


class RequestDrafting:
    """One request's drafters, draft-length policy and step timing.

    Args:
        chain: the request's drafters (see :func:`rag_accel.drafters.build_drafters`).
        policy: the request's :class:`~rag_accel.policy.DraftLengthPolicy`.
        costs: the engine's :class:`StepCosts`, shared by its requests.
        max_draft_tokens: most draft tokens one step verifies.
        max_loss: the fraction of this request's plain-greedy time that failed drafts may cost.
        probe_every: steps without asking the draft model before one probe ask.
    """

    def __init__(self, chain: DrafterChain, policy: DraftLengthPolicy, costs: StepCosts,
                 max_draft_tokens: int, max_loss: float, probe_every: int = 32) -> None:
        self.chain, self.policy, self.costs = chain, policy, costs
        self.max_draft_tokens, self.max_loss, self.probe_every = max_draft_tokens, max_loss, probe_every
        self.candidates: list[Draft] = []  # the last step's drafts, sent or not: they learn from its tokens
        self.prefill_s = 0.0  # the request's prefill time, for the loss budget
        self.prefill_steps: float | None = None  # or its cost in plain steps, where the engine knows that instead
        self.plain_s: float | None = None  # running time of this request's plain (one-token) steps
        self._since_plain = 0  # steps since this request last timed a plain step
        self._since_model = 0  # steps since a draft model was last asked

    @classmethod
    def from_config(cls, config: DecoderConfig, context: Sequence[int], references: Sequence[Sequence[int]],
                    cost_curve: Sequence[float], acceptance: AcceptanceStats, costs: StepCosts, *,
                    drafters: Sequence[Drafter] | None = None,
                    draft_model: Callable[[], Drafter] | None = None) -> RequestDrafting:
        """A request's drafting as ``config`` says: its drafters (``drafters`` instead, if given;
        ``draft_model`` makes a draft-model drafter) over ``context`` (the prompt; drafters index it
        and keep a reference to the list, which the engine extends) and ``references``."""
        chain = (DrafterChain(drafters) if drafters is not None
                 else build_drafters(config, context, references, draft_model))
        policy = DraftLengthPolicy(cost_curve, adaptive=config.adaptive, stats=acceptance)
        return cls(chain, policy, costs, config.max_draft_tokens, config.max_loss)

    def add_drafter(self, drafter: Drafter, order: Sequence[str]) -> None:
        """``drafter``, built off the step loop (a reference index), joins mid-request where ``order``
        (the config's drafter names) puts it: after the drafters named before it there, in front of
        the others. It sees the context's updates from here on.

        Example:
            >>> from rag_accel.drafters import DrafterChain, NgramDrafter, ReferenceDrafter
            >>> drafting = RequestDrafting(DrafterChain([NgramDrafter([1, 2, 3])]), None, StepCosts(), 8, 0.03)
            >>> drafting.add_drafter(ReferenceDrafter([[7, 8, 9]]), ("reference", "ngram"))
            >>> [d.name for d in drafting.chain.drafters]
            ['reference', 'ngram']
        """
        before = set(order[:order.index(drafter.name)]) if drafter.name in order else set(order)
        position = sum(1 for d in self.chain.drafters if d.name in before)
        self.chain.insert(position, drafter)

    # 1. learn
    def learn(self, context: Sequence[int], new_tokens: Sequence[int]) -> None:
        """``context`` (prompt + output) now ends with ``new_tokens``, the last step's output."""
        self.chain.update(context, len(new_tokens))
        for d in self.candidates:  # every candidate learns, sent or not
            self.policy.observe(d, new_tokens)

    # 2. choose
    def choose(self, context: Sequence[int], n_generated: int, remaining: int) -> tuple[Draft, int]:
        """The draft to verify next and how many of its tokens to send (0: a plain step).
        ``remaining``: tokens the request may still produce (a step always adds one of its own)."""
        max_len = min(self.max_draft_tokens, remaining - 1)
        policy = self.policy
        policy.scale_cost(self.costs.scale_at(len(context)))
        if policy.adaptive:
            for d in self.chain.priced:  # a drafter that prices its drafts hears what a draft token costs now
                d.price(policy.token_cost(d.priced_up_to))  # type: ignore[attr-defined]
            self.candidates = self.chain.candidates(context, max_len)
        else:
            self.candidates = [d for d in [self.chain.propose(context, max_len)] if d.tokens]
        budget = self.loss_budget(n_generated)
        draft, n_send = policy.select(self.candidates, budget)
        if n_send == 0 and self.chain.costly and policy.adaptive:  # references first, then the draft model
            draft, n_send = self._ask_draft_models(context, max_len, budget, remaining)
        return self.credited(draft, n_send, context), n_send

    def credited(self, draft: Draft, n_send: int, context: Sequence[int] = ()) -> Draft:
        """The draft whose name a step's tokens are counted under: the reference drafter's candidate when it proposes
        the same ``n_send`` tokens, ``draft`` renamed to the references when they hold its tokens after the
        context's last token, else ``draft`` (the same verify step either way: only the credit changes, and the
        policy learns from every candidate under its own name).

        The prompt usually holds the passages, so the frequency drafter (prompt + answer) proposes the copies the
        reference drafter does, often sooner (from a one-token match) and valued higher: the demo credited 32 of
        92 tokens to it and none to the passages, and a prediction that the prompt also holds counted no accepted
        prediction tokens. A copy that a passage or the prediction holds is credited to them.

        Example:
            >>> from rag_accel.drafters import reference_drafter
            >>> d = RequestDrafting(DrafterChain([reference_drafter([[5, 1, 2, 3, 4]])]), None, StepCosts(), 8, 0.03)
            >>> d.candidates = [Draft([1, 2, 3], 1, "frequency"), Draft([1, 2, 9], 2, "reference")]
            >>> [d.credited(d.candidates[0], n, [7, 5]).source for n in (2, 3)]  # the same two; 5, 1, 2, 3 held
            ['reference', 'reference']
            >>> d.credited(d.candidates[0], 3, [7, 6]).source  # after a 6 the references hold no 1, 2, 3
            'frequency'
        """
        if not n_send or draft.source == REFERENCE_SOURCE:
            return draft
        sent = draft.tokens[:n_send]
        for candidate in self.candidates:
            if candidate.source == REFERENCE_SOURCE and candidate.tokens[:n_send] == sent:
                return candidate
        if context:
            run = [context[-1], *sent]
            for r in self.chain.drafters:
                if getattr(r, "name", "") == REFERENCE_SOURCE and r.holds(run):  # type: ignore[attr-defined]
                    return Draft(draft.tokens, draft.match_len, REFERENCE_SOURCE, draft.probs)
        return draft

    def loss_budget(self, n_generated: int) -> float:
        """Plain steps failed drafts may still cost: ``max_loss`` of the plain-greedy time so far,
        prefill included (before this request has timed a plain step, at the engine's running
        one-token step time: a fresh request may draft from its first step)."""
        prefill = self.prefill_steps
        if prefill is None:
            plain = self.plain_s or self.costs.step_s
            if not plain:
                return 0.0
            prefill = self.prefill_s / plain
        return self.max_loss * (prefill + n_generated)

    def _ask_draft_models(self, context: Sequence[int], max_len: int, loss_budget: float,
                          remaining: int) -> tuple[Draft, int]:
        """No copy draft is worth sending: ask the draft model(s), if the cost model says it pays
        (or for one probe after ``probe_every`` steps without asking, if it nearly pays).
        Drafting time is charged to the loss budget."""
        costs, policy = self.costs, self.policy
        draft_cost = costs.draft_token_s / costs.step_s if costs.draft_token_s is not None and costs.step_s else None
        for drafter in self.chain.costly:
            catch_up = 0.0
            if costs.catchup_token_s is not None and costs.step_s and hasattr(drafter, "behind"):
                catch_up = drafter.behind(context) * costs.catchup_token_s / costs.step_s
            window = policy.model_window(drafter.name, draft_cost, max_len, loss_budget,
                                         probe=self._since_model >= self.probe_every, catch_up=catch_up,
                                         remaining=remaining)
            if window == 0:
                continue
            t0 = time.perf_counter()
            draft = drafter.propose(context, window)
            dt = time.perf_counter() - t0
            costs.learn_draft_model(drafter)
            if costs.step_s:
                policy.charge(dt / costs.step_s)  # all of it, catch-up included
            self._since_model = 0
            if draft.tokens:
                self.candidates.append(draft)  # learns from the step like the others
                return draft, len(draft.tokens)
            return NO_DRAFT, 0
        self._since_model += 1
        return NO_DRAFT, 0

    # 4. account
    def account(self, n_send: int, n_accepted: int, seconds: float, context_len: int) -> None:
        """The verify step of ``n_send`` draft tokens took ``seconds`` and accepted ``n_accepted``."""
        engine_s = self.costs.step_s  # (before this step)
        # A draft step is timed against plain steps timed near it, or not at all: the machine's speed drifts as
        # other processes come and go, and a long run of drafted steps would meet a stale plain-step time.
        self._since_plain = 0 if n_send == 0 else self._since_plain + 1
        plain_s = self.plain_s if self._since_plain <= PLAIN_NEAR else None
        timed_cost = self.costs.learn_step(self.policy, n_send, seconds, plain_s, context_len)
        if n_send == 0:  # a stall moves the request's plain-step time by 20% at most; its first, by 2x the engine's
            plain = self.plain_s
            if plain is None:
                self.plain_s = seconds if engine_s is None else _within_stall(seconds, engine_s)
            else:
                self.plain_s = 0.8 * plain + 0.2 * _within_stall(seconds, plain)
        # The loss budget is charged what the step really took (in this request's plain steps), but for a
        # stall: see DraftLengthPolicy.record.
        self.policy.record(n_send, n_accepted, timed_cost)
