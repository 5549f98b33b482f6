"""Our proposer's host work replayed (``host_replay.py``), one checkout of rag_accel against another, in
alternating processes: what a change of the library's code saved, on the same batches.

    git worktree add /tmp/base fe2b20f && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/experiments/host_replay_versions.py --outputs benchmarks/results/greedy_outputs_smollm2_last100x64.json \\
        --trees /tmp/base,. --rounds 4 --out benchmarks/results/host_replay_versions_smollm2
    python benchmarks/experiments/host_replay_versions.py --plot benchmarks/results/host_replay_versions_smollm2.json

(in the vLLM virtualenv). Each round runs every checkout once, in a fresh process that imports rag_accel from it
(its C build in place; the replay is this checkout's), ``--runs`` replays a level in each; a figure is the median over all runs of a checkout.
One process's median moved by up to 40% against the next's on a VM: hence rounds of processes, not runs in one.
The drafts' sha256 shows whether two checkouts drafted alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(tree: Path, outputs: Path, items: int, levels: list[int], runs: int, step_ms: float) -> None:
    """In a process of its own, started with ``tree`` first on PYTHONPATH: ours replayed with the library from
    ``tree`` (the replay itself is this checkout's ``host_replay.py``); prints one JSON line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import host_replay
    import rag_accel
    import rag_accel.kernels

    from rag_accel.rag.msmarco import load_msmarco_sample
    from rag_accel_lab.replay import PromptTokens, prepare

    if not Path(rag_accel.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"rag_accel came from {rag_accel.__file__}, not {tree}")
    saved = json.loads(outputs.read_text())
    by_id = {it.id: it for it in load_msmarco_sample(with_answers=True)}
    prepared = prepare(outputs, PromptTokens(saved["model"]), by_id)[-items:]
    got = {str(level): [host_replay.summary(host_replay.run_ours(prepared, level, step_ms / 1e3))
                        for _ in range(runs)] for level in levels}
    print(json.dumps({"native": rag_accel.kernels.NATIVE,
                      "runs": {lv: [(s["per_request_us_median"], s["drafts_sha256"]) for s in ss]
                               for lv, ss in got.items()}}))


def plot(path: Path) -> None:
    """Ours' host time per request per step, by version and requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(path.read_text())["rows"]
    levels = sorted({r["level"] for r in rows})
    versions = list(dict.fromkeys(r["commit"] for r in rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    width = 0.76 / len(versions)
    for i, version in enumerate(versions):
        got = {r["level"]: r["per_request_us_median"] for r in rows if r["commit"] == version}
        ax.bar([j + width * i for j in range(len(levels))], [got[lv] for lv in levels], width * 0.95, label=version)
    ax.set_xticks([j + width * (len(versions) - 1) / 2 for j in range(len(levels))],
                  [f"{lv} in flight" for lv in levels])
    ax.set_ylabel("host us per request per step")
    ax.set_title("Our proposer's host work replayed, by version of the code", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=Path, default=None, help="the model's greedy answers")
    ap.add_argument("--trees", default=None, help="checkouts of rag_accel, comma-separated (built in place)")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2, help="replays of each level in each process")
    ap.add_argument("--step-ms", type=float, default=28.0)
    ap.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plot", type=Path, default=None, help="draw a run's plot from its JSON, and nothing else")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.plot is not None:
        return plot(args.plot)
    levels = [int(x) for x in args.levels.split(",")]
    if args.one is not None:
        return one(args.one.resolve(), args.outputs, args.items, levels, args.runs, args.step_ms)
    if args.trees is None or args.outputs is None:
        ap.error("--trees and --outputs are required")
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    load_before = os.getloadavg()
    found: dict[str, dict] = {str(t): {"native": None, "runs": {str(lv): [] for lv in levels}} for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            cmd = [sys.executable, __file__, "--one", str(tree), "--outputs", str(args.outputs), "--items",
                   str(args.items), "--levels", args.levels, "--runs", str(args.runs), "--step-ms", str(args.step_ms)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
            line = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip()
            line = line.splitlines()[-1]
            got = json.loads(line)
            found[str(tree)]["native"] = got["native"]
            for lv, runs in got["runs"].items():
                found[str(tree)]["runs"][lv] += runs
            print(f"round {r + 1}: {tree}: " + ", ".join(f"{lv} in flight {[round(x, 1) for x, _ in runs]}"
                                                        for lv, runs in got["runs"].items()), flush=True)
    rows = []
    for tree, got in found.items():
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        for lv, runs in got["runs"].items():
            rows.append({"tree": tree, "commit": commit + ("+changes" if dirty else ""), "native": got["native"],
                         "level": int(lv), "per_request_us_median": statistics.median(x for x, _ in runs),
                         "runs_per_request_us": [round(x, 1) for x, _ in runs],
                         "drafts_sha256": sorted({d for _, d in runs})})
    for r in rows:
        print(f"{r['commit']:>16s} level {r['level']:3d}: {r['per_request_us_median']:6.1f} us per request per step "
              f"(runs {r['runs_per_request_us']}), drafts {r['drafts_sha256']}")
    if args.out is None:
        return
    from rag_accel_lab.machine import cpu_description

    result = {"command": "python benchmarks/experiments/host_replay_versions.py " + shlex.join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {cpu_description()}, {os.cpu_count()} cores",
              "load_before": load_before, "load_after": os.getloadavg(), "items": args.items, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["# Our proposer's host work replayed, one version of the code against another", "",
             f"- command: `{result['command']}`",
             f"- machine: {result['machine']}; load (1/5/15 min) before {' '.join(f'{x:.2f}' for x in load_before)}, "
             f"after {' '.join(f'{x:.2f}' for x in result['load_after'])}",
             f"- {args.rounds} rounds, each running every version once in a fresh process ({args.runs} replays of each "
             f"level there), alternating; a figure is the median over all replays of a version; the sample's last "
             f"{args.items} answers, no forward", "",
             "| version (commit) | C build | in flight | per request per step (median) | replays (us) | drafts "
             "(sha256) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['commit']} | {'yes' if r['native'] else 'no'} | {r['level']} | {r['per_request_us_median']:.1f} us "
              f"| {', '.join(f'{x:g}' for x in r['runs_per_request_us'])} | {', '.join(r['drafts_sha256'])} |"
              for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
