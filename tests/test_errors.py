"""Bad input gets a clear error with the numbers involved, and the decoder stays usable."""

from __future__ import annotations

import threading

import pytest
from helpers import hf_greedy, tiny_model

from rag_accel import DecoderConfig, ReferenceDecoder
from rag_accel.hf.loading import resolve_device


@pytest.fixture(scope="module")
def dec(tokenizer):
    return ReferenceDecoder(tiny_model("gpt2", len(tokenizer), seed=3), tokenizer, DecoderConfig(adaptive=False))


def still_works(dec):
    prompt = [5, 6, 7, 8]
    assert dec.generate(prompt, max_new_tokens=6).token_ids == hf_greedy(dec.model, prompt, 6)


def test_prompt_longer_than_context_window(dec):
    with pytest.raises(ValueError, match=r"prompt \(1100 tokens\).*1024"):
        dec.generate([1] * 1100, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompt \(1000 tokens\) \+ max_new_tokens \(100\) = 1100.*1024"):
        dec.generate([1] * 1000, max_new_tokens=100)
    still_works(dec)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(dec, prompt):
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate(prompt)
    still_works(dec)


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_bad_max_new_tokens(dec, n):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        dec.generate([1, 2], max_new_tokens=n)


@pytest.mark.parametrize("refs, msg", [
    (42, "references must be a list"),
    ([3.5], "reference 0 must be a string or a list of token ids, got float"),
    (["ok", {"text": "x"}], "reference 1 must be"),
    ([[1, 2, 10 ** 9]], r"reference 0 has token id 1000000000, outside the model's vocabulary \[0, 49152\)"),
])
def test_references_of_the_wrong_type(dec, refs, msg):
    with pytest.raises((TypeError, ValueError), match=msg):
        dec.generate([1, 2, 3], references=refs, max_new_tokens=3)
    still_works(dec)


def test_document_objects_get_a_hint(dec):
    class Doc:
        page_content = "text"

    with pytest.raises(TypeError, match=r"page_content"):
        dec.generate([1, 2, 3], references=[Doc()], max_new_tokens=2)


@pytest.mark.parametrize("refs", [None, [], [""], [[]], ["", "some text"]])
def test_empty_references_fall_back(dec, refs):
    prompt = [9, 8, 7, 9, 8]
    assert dec.generate(prompt, references=refs, max_new_tokens=8).token_ids == hf_greedy(dec.model, prompt, 8)


def test_huge_references_are_refused_past_the_limit(dec):
    with pytest.raises(ValueError, match=r"references hold 2000 tokens, more than max_reference_tokens=1000"):
        dec.generate([1, 2], references=[[1] * 2000], max_new_tokens=2,
                     config={"max_reference_tokens": 1000})
    still_works(dec)


def test_large_references_under_the_limit_are_served_with_a_warning(dec, monkeypatch):
    """References far past what a RAG answer copies from cost each request seconds to set up: served, said once."""
    import rag_accel.references as references

    monkeypatch.setattr(references, "LARGE_REFERENCE_TOKENS", 100)
    prompt = [9, 8, 7, 9, 8]
    with pytest.warns(UserWarning, match=r"references hold 300 tokens: tokenising and indexing them costs"):
        out = dec.generate(prompt, references=[[5, 6, 7] * 100], max_new_tokens=8)
    assert out.token_ids == hf_greedy(dec.model, prompt, 8)


def test_text_references_that_may_pass_the_limit_are_refused_at_the_call(dec):
    """Text whose token count only tokenising tells (more characters than the limit, too few to
    prove it) is tokenised when the call is made, so its refusal comes before any iteration; the
    rest is tokenised during the prefill."""
    with pytest.raises(ValueError, match=r"references hold \d+ tokens, more than max_reference_tokens=1000"):
        dec.stream([1, 2], references=["x " * 1000], max_new_tokens=2, config={"max_reference_tokens": 1000})
    still_works(dec)


def test_a_failing_set_up_raises_from_the_stream_and_the_decoder_keeps_serving(dec, monkeypatch):
    import rag_accel.references as references

    def broken(*args):
        raise RuntimeError("tokenizer broke")

    monkeypatch.setattr(references, "tokenize_references", broken)
    stream = dec.stream([1, 2, 3], references=["some text"], max_new_tokens=4)  # the call itself is fine
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        next(iter(stream))
    monkeypatch.undo()
    still_works(dec)


def test_wrong_prompt_types(dec):
    with pytest.raises(TypeError, match="prompt must be a string"):
        dec.generate(3.14)
    with pytest.raises(ValueError, match="needs 'role' and 'content'"):
        dec.generate([{"content": "hi"}])
    with pytest.raises(ValueError, match="token id -1"):
        dec.generate([1, -1])


def test_tokenizer_model_mismatch(tokenizer):
    small = tiny_model("llama", vocab_size=1000)
    with pytest.raises(ValueError, match=r"tokenizer has 49152 tokens but the model's embedding has 1000 rows"):
        ReferenceDecoder(small, tokenizer)
    with pytest.raises(TypeError, match="tokenizer must be"):
        ReferenceDecoder(small, "not a tokenizer")


def test_config_validation(dec):
    with pytest.raises(ValueError, match="unknown decoder option"):
        dec.generate([1, 2], config={"max_draft": 3})
    with pytest.raises(ValueError, match="unknown drafter"):
        DecoderConfig(drafters=("reference", "magic"))
    with pytest.raises(ValueError, match="max_draft_tokens must be an integer >= 1"):
        DecoderConfig(max_draft_tokens=0)
    with pytest.raises(ValueError, match="cost_curve needs"):
        DecoderConfig(max_draft_tokens=4, cost_curve=(1.0, 1.1))
    with pytest.raises(ValueError, match="adaptive must be a bool, got 'yes'"):
        DecoderConfig(adaptive="yes")
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        dec.generate([1, 2], stop=[""])


def test_unsupported_generation_config_is_refused(tokenizer):
    model = tiny_model("llama", len(tokenizer))
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match=r"repetition_penalty=1.3 changes greedy outputs"):
        ReferenceDecoder(model, tokenizer)


def test_cuda_without_gpu_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        resolve_device("cuda")


def test_concurrent_calls_each_get_their_own_answer(dec):
    prompts = [[i, i + 1, i + 2, i] for i in range(10, 16)]
    want = {tuple(p): hf_greedy(dec.model, p, 12) for p in prompts}
    got, errors = {}, []

    def work(p):
        try:
            got[tuple(p)] = dec.generate(p, references=[want[tuple(p)]], max_new_tokens=12).token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == want


# --- caches on a full disk -------------------------------------------------------------------------------------
# The model caches (~550 MB and ~470 MB) are written through storage.save_folder; a full disk once failed CI with
# a bare "No space left on device" from inside safetensors.

def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir())


def test_save_folder_writes_atomically(tmp_path):
    from rag_accel.rag.storage import save_folder

    def write(folder):
        (folder / "weights.bin").write_bytes(b"w" * 100)
        (folder / "config.json").write_text("{}")

    out = save_folder(tmp_path / "model", write, what="the model", marker="config.json")
    assert out == tmp_path / "model" and (out / "weights.bin").read_bytes() == b"w" * 100
    assert _leftovers(tmp_path) == ["model"]  # no temporary folder left beside it


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full for a real ENOSPC")
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path):
    from rag_accel.rag.storage import save_folder

    def write(folder):
        (folder / "weights.bin").write_bytes(b"w" * 100)  # half written ...
        with open("/dev/full", "wb") as f:  # ... then the disk is full: a real ENOSPC from the kernel
            f.write(b"x")
            f.flush()

    with pytest.raises(OSError, match=r"could not save the model \(about 1 MB\) under .*No space left on device.*"
                                      r"RAG_ACCEL_HOME"):
        save_folder(tmp_path / "model", write, what="the model (about 1 MB)", marker="config.json")
    assert _leftovers(tmp_path) == []  # neither the target nor a half-written temporary folder


def test_safetensors_io_errors_are_named_too(tmp_path):
    from safetensors import SafetensorError

    from rag_accel.rag.storage import save_folder

    def write(folder):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError, match="could not save the model under .*No space left on device") as info:
        save_folder(tmp_path / "model", write, what="the model", marker="config.json")
    assert isinstance(info.value.__cause__, SafetensorError)
    assert _leftovers(tmp_path) == []


def test_other_errors_while_saving_pass_through(tmp_path):
    from rag_accel.rag.storage import save_folder

    def write(folder):
        raise ValueError("weights are not contiguous")

    with pytest.raises(ValueError, match="not contiguous"):
        save_folder(tmp_path / "model", write, what="the model", marker="config.json")
    assert _leftovers(tmp_path) == []


def test_a_concurrent_writer_that_finished_first_wins(tmp_path):
    from rag_accel.rag.storage import save_folder

    def write(folder):
        (folder / "config.json").write_text("mine")
        (tmp_path / "model").mkdir()  # another process renames its finished copy into place meanwhile
        (tmp_path / "model" / "config.json").write_text("theirs")

    assert save_folder(tmp_path / "model", write, what="the model", marker="config.json") == tmp_path / "model"
    assert (tmp_path / "model" / "config.json").read_text() == "theirs"
    assert _leftovers(tmp_path) == ["model"]


def test_draft_model_only_chain_without_a_draft_model_is_refused_before_iteration(dec):
    with pytest.raises(ValueError, match="no draft model"):
        dec.stream([5, 6, 7], config={"drafters": ("draft_model",)})  # not iterated: stream() checks
    still_works(dec)


def test_a_backend_is_refused_before_loading():
    """One way to get a decoder per engine (issue 55): ReferenceDecoder is transformers'; asking it for vLLM
    names the class that is vLLM's, before anything loads."""
    with pytest.raises(ValueError, match=r"takes no backend= \(got 'vllm'\).*VllmDecoder.from_pretrained"):
        ReferenceDecoder.from_pretrained("smollm2-135m-instruct", backend="vllm")
    with pytest.raises(ValueError, match="takes no backend="):
        ReferenceDecoder.from_pretrained("smollm2-135m-instruct", backend="hf")
