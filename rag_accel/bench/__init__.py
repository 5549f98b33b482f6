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

The command line (:mod:`rag_accel.cli`) only parses arguments and calls these.
"""

from ..methods import (
    ALL_METHODS,
    BASELINES,
    DEFAULT_COPY_DRAFTERS,
    NEEDS_DRAFT_MODEL,
    OUR_METHODS,
    REMEMBERS_OUTPUTS,
    VLLM_METHODS,
)
from .drafting import propose_cost, propose_table, write_drafting_report
from .harness import (
    REWORDED,
    VLLM_ENV_RECORDED,
    VLLM_HINT,
    baseline_of,
    environment,
    peer_environment,
    reworded_items,
    run_benchmark,
    run_concurrency,
    spare_engine,
    too_long,
    vllm_engines,
)
from .report import PLOT_HINT, BenchReport, loadavg, plot
from .results import (
    ENGINES_LEGEND,
    SPLIT_LEGEND,
    TABLE_LEGEND,
    BatchRun,
    Run,
    concurrency_table,
    item_seconds,
    markdown_table,
    split_table,
    summarize,
    summarize_concurrency,
)
from .timing import ForwardTimes, median_run, where_the_time_went

__all__ = [
    "ALL_METHODS", "BASELINES", "DEFAULT_COPY_DRAFTERS", "ENGINES_LEGEND", "NEEDS_DRAFT_MODEL", "OUR_METHODS",
    "PLOT_HINT", "REMEMBERS_OUTPUTS", "REWORDED", "SPLIT_LEGEND", "TABLE_LEGEND", "VLLM_ENV_RECORDED", "VLLM_HINT",
    "VLLM_METHODS", "BatchRun", "BenchReport", "ForwardTimes", "Run", "baseline_of", "concurrency_table",
    "environment", "item_seconds", "loadavg", "markdown_table", "median_run", "peer_environment", "plot", "propose_cost", "propose_table", "reworded_items", "run_benchmark",
    "run_concurrency", "spare_engine", "split_table", "summarize", "summarize_concurrency", "too_long",
    "vllm_engines", "where_the_time_went", "write_drafting_report",
]
