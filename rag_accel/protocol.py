"""What every decoder shares: its surface, its sampling rule, and how a request's config changes are read.

Three decoders answer the same calls: :class:`~rag_accel.hf.decoder.ReferenceDecoder` (transformers, in
process), :class:`~rag_accel.vllm.VllmDecoder` (vLLM, in process) and
:class:`~rag_accel.serving.remote.RemoteDecoder` (a ``rag-accel serve`` server over HTTP). :class:`Decoder`
is that surface; an application (or an adapter) written against it runs on any of them.

The rules below are the one copy each decoder applies:

* :func:`sampling_request`: greedy unless ``do_sample``; sampling arguments without it are an error;
  the values not given are the model's own defaults (its ``generation_config``), filled in by the
  engine that runs the model: transformers' generation config in process, vLLM's default sampling
  parameters (read from the same file) in process or on the server.
* :func:`call_config`: the :class:`~rag_accel.config.DecoderConfig` a call runs with, built once where the
  call enters (what travels on to a vLLM engine is :class:`rag_accel.vllm.requests.RequestArgs`).

No engine is imported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from .config import DecoderConfig
from .inputs import check_stops
from .outputs import GenerationOutput

if TYPE_CHECKING:
    from typing_extensions import Unpack

SAMPLING_ARGS = ("temperature", "top_k", "top_p", "seed")


class CallOptions(TypedDict, total=False):
    """The per-call options of ``generate`` / ``stream`` / ``generate_batch`` on every decoder, declared once: each
    decoder's methods take them as ``**options: Unpack[CallOptions]``, and :meth:`Request.of` checks them.

    - ``max_new_tokens``: most tokens to generate. ``stop``: stop string(s); the text ends before the first one (the
      token ids end with the token that completed it).
    - ``config``: a :class:`~rag_accel.config.DecoderConfig` or a dict of changes to the decoder's, for this call.
    - ``speculate``: ``False``: no drafting for this call (the output is the same).
    - ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``: sampling, distributed as the model's own (unset
      values from the model's generation config; ``seed`` makes an output reproducible).
    - ``answers``: earlier answers of this model to copy from (a cached answer to a similar question), strings or
      token-id lists, drafted as the memory of answers drafts; with the references they count against
      ``max_reference_tokens``.
    - ``prediction``: OpenAI's Predicted Outputs (``{"type": "content", "content": text or [{"type": "text", "text":
      ...}, ...]}``, :mod:`rag_accel.prediction`): each text part one more reference, counted in
      ``stats.accepted_prediction_tokens``.

    In generate_batch ``answers`` and ``prediction`` hold one entry per prompt, as references
    (:func:`batch_arguments`)."""

    max_new_tokens: int
    stop: str | Sequence[str] | None
    config: DecoderConfig | Mapping[str, Any] | None
    speculate: bool
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    seed: int | None
    answers: Any
    prediction: Any


# Their defaults (the keys are CallOptions', tests/test_protocol.py).
CALL_OPTIONS: dict[str, Any] = dict(max_new_tokens=256, stop=None, config=None, speculate=True, do_sample=False,
                                    temperature=None, top_k=None, top_p=None, seed=None, answers=None,
                                    prediction=None)
PER_PROMPT = ("answers", "prediction")


@dataclass(frozen=True)
class Request:
    """One call, built and checked once where it enters a decoder (:meth:`of`), then handed whole to the engine:
    its prompt and references as given (each engine encodes them), its stop strings checked, its sampling read by
    :func:`sampling_request` (``None``: greedy), the other options as given.

    Example:
        >>> r = Request.of("Hi", ["a passage"], {"max_new_tokens": 8, "stop": "\\n"})
        >>> r.max_new_tokens, r.stops, r.sampling
        (8, ['\\n'], None)
        >>> Request.of("Hi", None, {"max_tokens": 8})
        Traceback (most recent call last):
        ...
        TypeError: unexpected keyword arguments ['max_tokens'] (max_tokens: this call's name is max_new_tokens)
    """

    prompt: Any
    references: Any = None
    max_new_tokens: int = 256
    stops: list[str] = field(default_factory=list)
    config: DecoderConfig | Mapping[str, Any] | None = None
    speculate: bool = True
    sampling: dict[str, Any] | None = None
    answers: Any = None
    prediction: Any = None

    @classmethod
    def of(cls, prompt: Any, references: Any = None, options: Mapping[str, Any] | None = None) -> Request:
        """The request a call's arguments make: unknown options refused (naming ours for another API's name),
        ``stop`` and ``speculate`` checked, the sampling arguments read (refused without ``do_sample``)."""
        options = {} if options is None else options
        check_options(options)
        o = {**CALL_OPTIONS, **options}
        if not isinstance(o["speculate"], bool):
            raise TypeError(f"speculate must be a bool, got {type(o['speculate']).__name__}")
        sampling = sampling_request(o["do_sample"], o["temperature"], o["top_k"], o["top_p"], o["seed"])
        return cls(prompt, references, o["max_new_tokens"], check_stops(o["stop"]), o["config"], o["speculate"],
                   sampling, o["answers"], o["prediction"])


@runtime_checkable
class Decoder(Protocol):
    """The surface of every rag_accel decoder. ``prompt``: text, chat messages or token ids;
    ``references``: the documents to copy from (strings or token-id lists); ``answers``: earlier answers to
    copy from; ``prediction``: OpenAI's Predicted Outputs shape, each text part one more reference
    (:mod:`rag_accel.prediction`); ``speculate=False``: no drafting for that call (the engine's plain
    decoding behind the same surface)."""

    def generate(self, prompt: Any, references: Any = None,
                 **options: Unpack[CallOptions]) -> GenerationOutput: ...

    def stream(self, prompt: Any, references: Any = None, **options: Unpack[CallOptions]) -> Iterator[str]: ...

    def generate_batch(self, prompts: Sequence[Any], references: Sequence[Any] | None = None,
                       **options: Unpack[CallOptions]) -> list[GenerationOutput]: ...

    def generate_greedy(self, prompt: Any, *, max_new_tokens: int = 256,
                        stop: str | Sequence[str] | None = None) -> GenerationOutput: ...

    def encode_prompt(self, prompt: Any) -> list[int]: ...

    def close(self) -> None: ...


def batch_arguments(prompts: Sequence[Any], references: Sequence[Any] | None,
                    options: Mapping[str, Any]) -> tuple[list[Any], list[Any], list[dict[str, Any]]]:
    """``generate_batch``'s arguments checked: (prompts, one references entry per prompt, one dict of
    options per prompt, with their defaults). Options are the same for every prompt but ``answers`` and
    ``prediction``, which, like ``references``, hold one entry per prompt. Unknown options are a
    ``TypeError``, as in ``generate``.

    Example:
        >>> _, refs, opts = batch_arguments(["a", "b"], None, {"max_new_tokens": 8, "answers": [["x"], None]})
        >>> refs, [o["answers"] for o in opts], opts[0]["max_new_tokens"]
        ([None, None], [['x'], None], 8)
    """
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts")
    refs = list(references) if references is not None else [None] * len(prompts)
    if len(refs) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(refs)} reference lists")
    check_options(options)
    per_prompt = {}
    for name in PER_PROMPT:
        given = options.get(name)
        if given is None:
            given = [None] * len(prompts)
        elif isinstance(given, (str, Mapping)) or not isinstance(given, Sequence) or len(given) != len(prompts):
            raise ValueError(f"{name} in generate_batch: one entry per prompt ({len(prompts)}), as references")
        per_prompt[name] = list(given)
    return list(prompts), refs, [{**CALL_OPTIONS, **options, **{n: per_prompt[n][i] for n in PER_PROMPT}}
                                 for i in range(len(prompts))]


# Names other APIs use for a call option, and ours (a hint where one is passed).
_ALIASES = {"max_tokens": "max_new_tokens", "stop_sequences": "stop", "stop_strings": "stop",
            "documents": "references"}


def check_options(options: Mapping[str, Any]) -> None:
    """Refuse keyword arguments no decoder call takes, naming ours where another API's name was used.

    Example:
        >>> check_options({"max_new_tokens": 8})
        >>> check_options({"max_tokens": 8})
        Traceback (most recent call last):
        ...
        TypeError: unexpected keyword arguments ['max_tokens'] (max_tokens: this call's name is max_new_tokens)
    """
    unknown = sorted(set(options) - set(CALL_OPTIONS))
    if unknown:
        hints = [f"{k}: this call's name is {_ALIASES[k]}" for k in unknown if k in _ALIASES]
        raise TypeError(f"unexpected keyword arguments {unknown}" + (f" ({'; '.join(hints)})" if hints else ""))


def sampling_request(do_sample: bool, temperature: Any = None, top_k: Any = None, top_p: Any = None,
                     seed: Any = None) -> dict[str, Any] | None:
    """``None``: greedy decoding. Otherwise the sampling arguments given (``None`` ones left out: the
    engine fills them from the model's generation config). Sampling arguments without ``do_sample``
    are refused, by every decoder alike.

    Example:
        >>> sampling_request(False) is None
        True
        >>> sampling_request(True, temperature=0.7)
        {'temperature': 0.7}
    """
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    given = {k: v for k, v in zip(SAMPLING_ARGS, (temperature, top_k, top_p, seed)) if v is not None}
    if not do_sample:
        if given:
            raise ValueError(f"{sorted(given)} only apply to sampling: pass do_sample=True "
                             "(greedy decoding is the default)")
        return None
    return given


def call_config(config: DecoderConfig | Mapping[str, Any] | None, base: DecoderConfig) -> DecoderConfig:
    """The :class:`DecoderConfig` one call runs with: ``base`` (the decoder's) without a ``config``, a
    ``DecoderConfig`` as given, or a dict of changes applied to ``base`` (checked: a ``ValueError`` names a bad
    one). Built once, where the call enters the decoder.

    Example:
        >>> call_config({"max_loss": 0.1}, DecoderConfig()).max_loss
        0.1
    """
    if config is None:
        return base
    if isinstance(config, DecoderConfig):
        return config
    if isinstance(config, Mapping):
        return base.replace(**config)
    raise TypeError(f"config must be a DecoderConfig or a dict, got {type(config).__name__}")
