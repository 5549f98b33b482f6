"""Side-by-side benchmark: plain greedy, Hugging Face prompt lookup, and ours; on vLLM too.

One place for the benchmark tooling, split by concept:

- :mod:`~rag_accel.bench.harness`: the loop (:func:`run_benchmark`, :func:`run_concurrency`),
  the vLLM engines, the items too long for the model (:func:`too_long`).
- :mod:`~rag_accel.bench.results`: the records (:class:`Run`, :class:`BatchRun`), their summaries
  and the markdown tables (plain Python).
- :mod:`~rag_accel.bench.report`: the files a ``rag-accel bench`` run writes (:class:`BenchReport`)
  and the plot (matplotlib, the ``[bench]`` extra).
- :mod:`~rag_accel.bench.timing`: ``rag-accel demo``'s timing (forward passes, prefill, median run).
- :mod:`~rag_accel.bench.drafting`: the drafting micro-benchmark (``rag-accel bench-drafting``).

The lab that only ``benchmarks/`` uses (replays on known answers, requests in flight) is not here: it is
``rag_accel_lab`` in ``benchmarks/rag_accel_lab/``, outside the wheel.

The command line (:mod:`rag_accel.cli`) only parses arguments and calls these. Import each name from its module
(``from rag_accel.bench.harness import run_benchmark``): the package re-exports nothing.
"""
