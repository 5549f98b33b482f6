"""A stream may move between threads: iterating it, dropping it half-read, or waiting for it
from another thread never breaks or locks the decoder (the model lock is held per step)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from helpers import OracleDrafter, hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder

N = 24


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = tiny_model("llama", len(tokenizer), seed=5)
    dec = ReferenceDecoder(model, tokenizer, DecoderConfig(adaptive=False, max_draft_tokens=4))
    prompt = tokenizer("The capital of France is")["input_ids"]
    return dec, prompt, hf_greedy(model, prompt, N)


def _in_thread(fn, timeout=60.0):
    """Run ``fn`` in a new thread; its result, or its exception re-raised here. A thread still
    running after ``timeout`` seconds fails the test (a deadlock), not hangs it."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked: the decoder's lock was never released"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _generate_elsewhere(dec, prompt, n=8):
    return _in_thread(lambda: dec.generate(prompt, max_new_tokens=n).token_ids)


def test_stream_iterated_from_two_threads(setup):
    dec, prompt, want = setup
    stream = dec.stream(prompt, max_new_tokens=N, references=[want])
    it = iter(stream)
    first = _in_thread(lambda: next(it))  # the first step (prefill) in another thread
    rest = list(it)  # the rest here
    assert stream.output is not None
    assert stream.output.token_ids == want
    assert first + "".join(rest) == stream.output.text
    assert _generate_elsewhere(dec, prompt) == want[:8]


def test_every_step_on_a_different_thread(setup):
    dec, prompt, want = setup
    stream = dec.stream(prompt, max_new_tokens=N,
                        drafters=[OracleDrafter(want, len(prompt), "mix", dec.vocab_size, seed=1)])
    it = iter(stream)
    pieces = []
    while True:
        piece = _in_thread(lambda: next(it, None))
        if piece is None:
            break
        pieces.append(piece)
    assert stream.output.token_ids == want and "".join(pieces) == stream.output.text


async def test_run_in_executor_next(setup):
    """The ordinary asyncio pattern: each next() on whichever executor thread is free."""
    dec, prompt, want = setup
    loop = asyncio.get_running_loop()

    async def consume():
        stream = dec.stream(prompt, max_new_tokens=N, references=[want[3:]])
        it, done, pieces = iter(stream), object(), []
        while (piece := await loop.run_in_executor(None, next, it, done)) is not done:
            pieces.append(piece)
        return stream.output, "".join(pieces)

    results = await asyncio.wait_for(asyncio.gather(*(consume() for _ in range(3))), 120)
    for output, text in results:
        assert output.token_ids == want and text == output.text


def test_half_read_stream_dropped_in_another_thread(setup):
    dec, prompt, want = setup
    stream = dec.stream(prompt, max_new_tokens=N, references=[want])
    it = iter(stream)
    next(it)
    next(it)
    holder = [stream, it]
    del stream, it

    def drop():  # the generator's cleanup runs on this thread
        holder.clear()
        gc.collect()

    _in_thread(drop)
    assert _generate_elsewhere(dec, prompt) == want[:8]
    assert dec.generate(prompt, max_new_tokens=N).token_ids == want


def test_a_waiting_caller_proceeds_while_a_stream_is_paused(setup):
    """A stream paused between steps does not hold the model: another thread's call runs,
    and the paused stream then finishes with the right output."""
    dec, prompt, want = setup
    stream = dec.stream(prompt, max_new_tokens=N, references=[want])
    it = iter(stream)
    next(it)
    assert _generate_elsewhere(dec, prompt, N) == want  # would block for good if the lock spanned the yield
    list(it)
    assert stream.output.token_ids == want


def test_concurrent_streams_interleave_step_by_step(setup):
    """Threads streaming on one decoder take turns per step; each output stays exact."""
    dec, prompt, want = setup
    results: list = [None] * 4
    barrier = threading.Barrier(4)

    def run(i):
        barrier.wait()
        results[i] = dec.generate(prompt, max_new_tokens=N, references=[want[i:]]).token_ids

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert results == [want] * 4
