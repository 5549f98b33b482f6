"""Multi-turn conversations whose earlier turns are references for the next answer.

The LLMA paper's third scenario: follow-up answers repeat what was said
before. :class:`Conversation` keeps the turns and passes them (the user's and
the model's), together with whatever retrieval and the response cache return,
as references to the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cache import ResponseCache
from .msmarco import SYSTEM_PROMPT, rag_prompt
from ..outputs import GenerationOutput
from ..protocol import Decoder
from .retrieval import SearchHit, VectorIndex


@dataclass
class Turn:
    question: str
    answer: str
    passages: list[SearchHit] = field(default_factory=list)
    output: GenerationOutput | None = None


class Conversation:
    """A chat whose references are its own history plus retrieved passages, with cached answers.

    Args:
        decoder: the model: any :class:`~rag_accel.protocol.Decoder` (transformers, vLLM or a server).
        index: optional passage index; its top ``k`` hits for each question are
            put in the prompt and passed as references.
        cache: optional response cache; answers to similar past questions are
            passed as ``answers=`` (not put in the prompt), and each answer is stored.
        system: system prompt.
    """

    def __init__(self, decoder: Decoder, *, index: VectorIndex | None = None, k: int = 3,
                 cache: ResponseCache | None = None, system: str | None = SYSTEM_PROMPT) -> None:
        self.decoder, self.index, self.k, self.cache, self.system = decoder, index, k, cache, system
        self.turns: list[Turn] = []

    def messages(self, question: str, passages: list[str]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            msgs += [{"role": "user", "content": t.question}, {"role": "assistant", "content": t.answer}]
        msgs.append({"role": "user", "content": rag_prompt(question, passages)})
        return msgs

    def references(self, question: str, passages: list[str]) -> list[str]:
        """The next answer's references: the earlier turns and the passages."""
        refs = [text for t in self.turns for text in (t.answer, t.question)]
        return refs + passages

    def answers(self, question: str) -> list[str]:
        """Cached answers to questions like ``question`` (``answers=``: drafted as earlier answers are)."""
        return self.cache.references(question) if self.cache is not None else []

    def ask(self, question: str, **generate_kwargs: Any) -> Turn:
        """Answer ``question`` in the context of the earlier turns and record the turn."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        hits = self.index.search(question, self.k) if self.index is not None else []
        passages = [h.text for h in hits]
        out = self.decoder.generate(self.messages(question, passages),
                                    references=self.references(question, passages),
                                    answers=self.answers(question), **generate_kwargs)
        turn = Turn(question, out.text, hits, out)
        self.turns.append(turn)
        if self.cache is not None:
            self.cache.put(question, out.text)
        return turn
