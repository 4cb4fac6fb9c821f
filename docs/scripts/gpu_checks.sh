#!/usr/bin/env bash
# The GPU checks in one call (docs/speed-and-memory.md, GPU section): run from the repository root on a
# machine with one CUDA GPU, the image's python3 holding torch and triton, the package from src/.
#   OUT=/some/dir DATA=.gpu-data bash docs/scripts/gpu_checks.sh [STAGE ...]
# Stages (default: all, in this order): bench32k tests bench128k decode imdb; also compile (COMPILE_MODES) and news
# (20NEWS-1500, the CPU grid's configuration: NEWS, NEWS_SEEDS, NEWS_LIMIT), decoderef (bench decode --references at
# two shapes) and mlm (the masked-LM grids at 512 and 2,048 tokens: MLM512, MLM2048, MLM_STEPS, MLM_LIMIT; DATA
# also needs tinyshakespeare/ and wikitext-2/), not in the default.
# DATA holds imdb/ and 20news/ (copies of ../shared/data's) for the training-time runs. Each stage
# has its own time limit, so one slow stage cannot starve the rest; everything lands in /tmp/gpu and is packed into
# $OUT/gpu.tgz after every stage (what finished comes back even if the call is cut off).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
DATA=${DATA:-.gpu-data}
NAMES32K=${NAMES32K:-full,neural-clustering,improved-clustered,lsh,cluster-select,sliding-window,kmeans,routing,clustered}
IMDB=${IMDB:-full neural-clustering}
IMDB_LIMIT=${IMDB_LIMIT:-75}
NEWS=${NEWS:-full sliding-window neural-clustering}
NEWS_SEEDS=${NEWS_SEEDS:-0}
NEWS_LIMIT=${NEWS_LIMIT:-90}
MLM512=${MLM512:-full;neural-clustering;sliding-window;cluster-select;lsh;kmeans;routing}
MLM2048=${MLM2048:-full;neural-clustering;sliding-window;cluster-select}
MLM_STEPS=${MLM_STEPS:-600}
MLM_LIMIT=${MLM_LIMIT:-360}
W=/tmp/gpu
mkdir -p "$W"
pack() { tar czf "$OUT/gpu.tgz" -C /tmp gpu; }
stage() { echo "=== $(date -u +%T) $1"; }
# grid TASK OUTDIR NAMES SEEDS LIMIT TRAIN_FLAGS...: one `compare` call per mechanism, each within LIMIT seconds,
# its checkpoints dropped and everything packed after it; then the records' accuracy, time and device peak.
grid() {
    local task=$1 out=$W/$2 names=$3 seeds=$4 limit=$5 name
    shift 5
    for name in $names; do
        timeout "$limit" python3 -m clusterformer compare --tasks "$task" --attention "$name" --seeds "$seeds" \
            --out "$out" -- "$@" --data-dir "$DATA" 2>&1 | tail -4
        find "$out" -name "*.pt" -delete
        pack
    done
    grep -h "seconds_per_epoch\|accuracy\|peak_device_mb" "$out/$task"/*/seed*/metrics.json 2>/dev/null
}
STAGES=${*:-bench32k tests bench128k decode imdb}

stage "machine"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

for s in $STAGES; do case $s in
bench32k)
    stage "bench attention 32k, eager and CUDA graphs"
    timeout 200 python3 -m clusterformer bench attention --device cuda --dtype bf16 --lengths 32768 --cuda-graph \
        --names "$NAMES32K" --repeats 10 --warmup 3 --json $W/bench-graph-32k.json 2>&1 | tee $W/bench-graph-32k.log ;;
tests)
    stage "CUDA graph tests"
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/attention/test_cuda.py -k graph tests/bench/test_graphs.py \
        2>&1 | tail -25 | tee $W/pytest-graph.log ;;
fused)
    stage "fused kernel tests on CUDA"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_fused_kernel.py 2>&1 | tail -8 | tee $W/pytest-fused.log ;;
bench128k)
    stage "bench attention 128k, eager and CUDA graphs"
    timeout 80 python3 -m clusterformer bench attention --device cuda --dtype bf16 --lengths 131072 --cuda-graph \
        --names full,neural-clustering,cluster-select --repeats 10 --warmup 3 --json $W/bench-graph-128k.json \
        2>&1 | tee $W/bench-graph-128k.log ;;
compile)
    stage "bench attention 32k under torch.compile"
    for mode in ${COMPILE_MODES:-reduce-overhead max-autotune-no-cudagraphs}; do
        timeout 150 python3 -m clusterformer bench attention --device cuda --dtype bf16 --lengths 32768 \
            --compile $mode --names full,neural-clustering --repeats 10 --warmup 3 --json $W/bench-compile-$mode.json \
            2>&1 | tee $W/bench-compile-$mode.log
    done ;;
decode)
    stage "bench decode 16k-128k"
    timeout 90 python3 -m clusterformer bench decode --device cuda --dtype bfloat16 --cuda-graph \
        --names "${DECODE_NAMES:-full,neural-clustering,sliding-window,cluster-select}" \
        --contexts 16384,65536,131072 --json $W/decode-cuda.json 2>&1 | tee $W/decode-cuda.log ;;
imdb)
    stage "IMDB-4K training time on the GPU (seed 0: $IMDB)"
    grid imdb imdb-4k-gpu "$IMDB" 0 "$IMDB_LIMIT" --max-len 4000 --limit 2500 --epochs 2 --dim 64 --depth 2 \
        --heads 4 --batch-size 8 --lr 1e-3 --warmup-steps 100 --checkpoint-every 100 ;;
news)
    stage "20NEWS-1500 training time on the GPU (seeds $NEWS_SEEDS: $NEWS)"
    grid 20news 20news-1500-gpu "$NEWS" "$NEWS_SEEDS" "$NEWS_LIMIT" --max-len 1500 --max-steps 500 --dim 64 \
        --depth 2 --heads 4 --batch-size 8 --lr 5e-3 --warmup-steps 100 --checkpoint-every 100 ;;
decoderef)
    stage "bench decode with the sdpa-decode and projections references: B 1 x 4 heads, then B 4 x 32 heads"
    timeout 120 python3 -m clusterformer bench decode --device cuda --dtype bfloat16 --cuda-graph --references \
        --names "${DECODE_NAMES:-full,neural-clustering,sliding-window}" --contexts 16384,65536,131072 \
        --json $W/decode-ref-b1h4.json 2>&1 | tee $W/decode-ref-b1h4.log
    pack
    timeout 150 python3 -m clusterformer bench decode --device cuda --dtype bfloat16 --cuda-graph --references \
        --batch 4 --heads 32 --names "${DECODE_NAMES:-full,neural-clustering,sliding-window}" \
        --contexts 16384,65536 --json $W/decode-ref-b4h32.json 2>&1 | tee $W/decode-ref-b4h32.log ;;
mlm)
    stage "masked-LM pretraining: $MLM512 at 512 tokens and $MLM2048 at 2,048, all at once"
    # Same model and tokens per step at both lengths (16,384: 32 x 512, 8 x 2,048); every run of both grids shares
    # the GPU and the 16 cores at once, so their s / step are not clean timings.
    for spec in "512 32 $MLM512" "2048 8 $MLM2048"; do
        set -- $spec
        timeout "$MLM_LIMIT" python3 -m clusterformer compare --tasks mlm --seeds 0 --jobs 8 --out $W/mlm-$1-gpu \
            --attention "$3" -- --max-len $1 --batch-size $2 --max-steps "$MLM_STEPS" --dim 64 --depth 2 --heads 4 \
            --lr 1e-3 --warmup-steps 60 --vocab-size 8000 --task-options '{"eval_windows": 64}' \
            --checkpoint-every 100000 --data-dir "$DATA" > $W/mlm-$1-gpu.log 2>&1 &
    done
    wait
    find $W -name "*.pt" -delete
    tail -3 $W/mlm-*-gpu.log
    grep -h "perplexity\"\|train_seconds\|peak_device_mb" $W/mlm-*-gpu/mlm/*/seed0/metrics.json ;;
*) echo "unknown stage $s"; exit 2 ;;
esac; pack; done
stage "done"
