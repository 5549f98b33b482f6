"""The benchmarks' lab, kept out of rag_accel's wheel (issue 65): what only ``benchmarks/`` and its tests use.

- :mod:`rag_accel_lab.replay`: drafting replayed on a model's known answers, and step prices, for the replays in
  ``benchmarks/experiments/``;
- :mod:`rag_accel_lab.inflight`: requests in flight on vLLM engines, for the scripts that time groups of them;
- :mod:`rag_accel_lab.machine`: the CPU a timed run's page names, with its bfloat16 units.

Installed with the checkout's dev tools (``pip install -e benchmarks``, in the README's test command), so the
scripts import it by name, never through ``sys.path``. It uses only rag_accel's public names.
"""
