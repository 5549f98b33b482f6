"""Reranking quality on the TREC-DL sample: nDCG@10 of each embedder's order vs the BM25 order.

    python benchmarks/retrieval_quality.py --out benchmarks/results/retrieval_trecdl

For each of the 97 TREC-DL 2019/2020 queries, the BM25 top-10 passages (with
NIST grades 0-3) are reranked by cosine similarity of the embedder's query and
passage vectors; nDCG@10 is computed with ranx against the judged grades
(unjudged passages count as non-relevant), for BM25's own order and each embedder.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path



def load_trecdl():
    base = Path(str(resources.files("rag_accel") / "data"))
    items = [json.loads(line) for line in (base / "msmarco_trecdl_rag.jsonl").open()]
    metas = {m["id"]: m for m in (json.loads(line) for line in (base / "msmarco_trecdl_rag.meta.jsonl").open())}
    return items, metas


def main() -> None:
    from ranx import Qrels, Run, evaluate

    from rag_accel.rag.retrieval import OFFLINE_E5, OFFLINE_MINILM, Embedder

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedders", default=f"{OFFLINE_E5},{OFFLINE_MINILM}")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    items, metas = load_trecdl()
    qrels = Qrels.from_dict({it["id"]: {d: int(g) for d, g in zip(metas[it["id"]]["docids"],
                                                                   metas[it["id"]]["qrels_grade"]) if g is not None}
                             for it in items})
    runs = {"bm25": Run.from_dict({it["id"]: dict(zip(metas[it["id"]]["docids"], metas[it["id"]]["bm25_scores"]))
                                   for it in items}, name="bm25")}
    timing = {}
    for name in args.embedders.split(","):
        emb = Embedder(name)
        t0 = time.perf_counter()
        run = {}
        for it in items:
            q = emb.embed_queries([it["query"]])[0]
            scores = emb.embed_passages(it["passages"]) @ q
            run[it["id"]] = {d: float(s) for d, s in zip(metas[it["id"]]["docids"], scores)}
        timing[name] = time.perf_counter() - t0
        runs[name] = Run.from_dict(run, name=name)
    results = {name: float(evaluate(qrels, run, "ndcg@10")) for name, run in runs.items()}
    lines = ["| ranking of the BM25 top-10 | nDCG@10 |", "|---|---|"]
    lines += [f"| {n} | {v:.4f} |" for n, v in results.items()]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        cmd = f"python benchmarks/retrieval_quality.py --embedders {args.embedders} --out {args.out}"
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        out.with_suffix(".json").write_text(json.dumps({"date": date, "command": cmd, "queries": len(items),
                                                        "ndcg@10": results, "embed_seconds": timing}, indent=1))
        out.with_suffix(".md").write_text(
            f"# Reranking the BM25 top-10 of TREC-DL 2019+2020 ({len(items)} queries)\n\n- date: {date}, CPU\n"
            f"- command: `{cmd}`\n- metric: nDCG@10 (ranx) against NIST grades; unjudged = 0\n\n{table}\n")


if __name__ == "__main__":
    main()
