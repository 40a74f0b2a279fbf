#!/usr/bin/env bash
# The GPU figures and the GPU test run in one call, for a machine with an NVIDIA GPU whose own
# Python already holds torch (CUDA), transformers, numpy, pyarrow, pandas, click, pytest and
# pytest-xdist. actdb's other dependencies travel as wheels in .whl/ (built for that Python),
# and actdb/_native as a .so built for it.
#
#   bash benchmarks/gpu_check.sh            # results under $OUT (default /tmp/actdb-gpu)
#   SMALL=1 DEVICE=cpu bash benchmarks/gpu_check.sh   # every step at a small size, on a CPU:
#                                           # that the script runs end to end (a few minutes)
#
# 0. Ingest at real size (`benchmarks/gpu_ingest.py`): a Llama-3.2-1B-shaped model (random
#    weights) ingested against the hand-written hook cache, paired rounds (INGEST_SIZE), and a
#    SmolLM2-135M-shaped one for a new store's fixed cost (FIXED_SIZE, target < 0.3 s); then
#    `ingest_phases.py --prompts 1 --timeline` on each (where the fixed cost goes). First, so
#    that the figures the GPU is lent for come back whatever the later steps do.
# 1. `benchmarks/run.py --device cuda --keep-going`: the benchmark suite with queries, the
#    ingest and the torch baselines on the GPU; a workload that fails is recorded and the
#    others still run; the report is rewritten after each workload.
# 2. The test suite with ACTDB_TEST_DEVICE=cuda (tests/conftest.py): every query and ingest a
#    test runs in-process computes on the GPU and is checked against its float64 reference.
# 3. `benchmarks/run.py --device cpu --only ingest`: the ingest against its forward pass on the
#    host's CPUs, a machine with more cores than the two the CPU figures come from.
# 4. `benchmarks/ingest_phases.py --device cuda --timeline`: where a GPU ingest's time goes,
#    step by step and by thread, for one prompt (its fixed costs) and for 32.
# Each step has a time limit (INGEST_S, BENCH_S, TESTS_S, CPU_S, PHASES_S seconds; 0 skips the
# step), so the call ends inside its lease: the defaults add up to 570 s, under the 600 s a
# device call may run.
set -u
OUT=${OUT:-/tmp/actdb-gpu}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
if [ "$SMALL" = 1 ]; then  # the script checked end to end at a small size
    SCALE=${SCALE:-tiny} INGEST_SIZE=${INGEST_SIZE:-small} FIXED_SIZE=${FIXED_SIZE:-small}
    INGEST_ARGS=${INGEST_ARGS:-"--prompts 4 --tokens 32 --batch-size 2 --rounds 3"}
    PHASES_MODEL=${PHASES_MODEL:-tiny} PHASES_MODEL_32=${PHASES_MODEL_32:-tiny}
    WORKERS=${WORKERS:-2} CPU_S=${CPU_S:-0}
    TESTS=${TESTS:-"test_weight_probes"}
fi
SCALE=${SCALE:-medium}
INGEST_SIZE=${INGEST_SIZE:-1b}   # 1b, 135m or small (gpu_ingest.py --size)
FIXED_SIZE=${FIXED_SIZE:-135m}
INGEST_ARGS=${INGEST_ARGS:-"--prompts 32 --tokens 512 --batch-size 16 --rounds 3"}
PHASES_MODEL=${PHASES_MODEL:-"smol-135m llama-1b"}  # ingest_phases.py --model, one prompt
INGEST_S=${INGEST_S:-150}  # both sizes; 0 skips step 0
BENCH_S=${BENCH_S:-150}  # 102 s on an H100 machine (2026-11-26), 176 s (2026-11-27)
TESTS_S=${TESTS_S:-150}  # 13 modules: 97% in 130 s with 12 workers there; 15: 100% at 200 s
CPU_S=${CPU_S:-0}       # 0 skips step 3
PHASES_S=${PHASES_S:-60}  # 0 skips step 4 (the ingest phases of 32 prompts)
PHASES_MODEL_32=${PHASES_MODEL_32:-bench}
WORKERS=${WORKERS:-12}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/actdb-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/actdb-site:$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm \
    --format=csv >"$OUT/gpu.txt" 2>&1
$PY -c "import torch, duckdb, zarr, threadpoolctl, actdb, actdb._native as n; print('torch', torch.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0), 'duckdb',
duckdb.__version__, 'zarr', zarr.__version__, 'native', n.__file__)" 2>&1 | tee "$OUT/env.txt"

if [ "$INGEST_S" -gt 0 ]; then
    start=$(date +%s)
    timeout "$INGEST_S" bash -c "
        $PY benchmarks/gpu_ingest.py --size $FIXED_SIZE --device $DEVICE --rounds 5 \
            --prompts 1 --tokens 128 --output $OUT/ingest-$FIXED_SIZE.md \
            --workdir /tmp/actdb-gpu-ingest >$OUT/ingest-$FIXED_SIZE.log 2>&1
        $PY benchmarks/gpu_ingest.py --size $INGEST_SIZE --device $DEVICE $INGEST_ARGS \
            --output $OUT/ingest-$INGEST_SIZE.md --workdir /tmp/actdb-gpu-ingest \
            >$OUT/ingest-$INGEST_SIZE.log 2>&1
        for m in $PHASES_MODEL; do
            $PY benchmarks/ingest_phases.py --model \$m --device $DEVICE --prompts 1 \
                --repeats 2 --timeline --workdir /tmp/actdb-phases >$OUT/phases-\$m.txt 2>&1
        done"
    echo "ingest at real size: exit $? after $(( $(date +%s) - start )) s"
fi

if [ "$BENCH_S" -gt 0 ]; then
start=$(date +%s)
timeout "$BENCH_S" $PY benchmarks/run.py --scale "$SCALE" --device "$DEVICE" --keep-going \
    --output "$OUT/BENCHMARKS-$DEVICE.md" --workdir /tmp/actdb-bench >"$OUT/bench.log" 2>&1
echo "benchmark: exit $? after $(( $(date +%s) - start )) s"
fi

if [ "$TESTS_S" -gt 0 ]; then
start=$(date +%s)
# The modules whose queries and ingests run in-process (the CLI's run in subprocesses, on the
# CPU; SQL checks, stores and catalogs do no tensor work).
TESTS=${TESTS:-"test_query_functions test_handles test_engine test_lens test_faithful_checks
    test_faithful_generative test_ingest_families test_ingest_input test_native test_load
    test_ingest_safety test_plot test_real_families test_anchor_rows test_lazy"}
ACTDB_TEST_DEVICE=$DEVICE timeout "$TESTS_S" $PY -m pytest -v --tb=short -n "$WORKERS" \
    -p no:cacheprovider -rfE --durations=5 $(for t in $TESTS; do echo tests/*/"$t".py; done) \
    >"$OUT/tests.log" 2>&1
echo "tests: exit $? after $(( $(date +%s) - start )) s"
fi

if [ "$CPU_S" -gt 0 ]; then
    start=$(date +%s)
    timeout "$CPU_S" $PY benchmarks/run.py --scale "$SCALE" --device cpu --only ingest \
        --output "$OUT/BENCHMARKS-cpu-ingest.md" --workdir /tmp/actdb-bench-cpu \
        >"$OUT/cpu-ingest.log" 2>&1
    echo "cpu ingest: exit $? after $(( $(date +%s) - start )) s"
fi

if [ "$PHASES_S" -gt 0 ]; then
    start=$(date +%s)
    timeout "$PHASES_S" $PY benchmarks/ingest_phases.py --model "$PHASES_MODEL_32" \
        --device "$DEVICE" --prompts 32 \
        --repeats 3 --timeline --workdir /tmp/actdb-phases >"$OUT/phases-32.txt" 2>&1
    echo "phases: exit $? after $(( $(date +%s) - start )) s"
fi

echo "--- ingest at real size"
for f in "$OUT"/ingest-*.log; do [ -f "$f" ] && { echo "$f"; grep -v "^  " "$f" | tail -6; }; done
for m in $PHASES_MODEL; do head -14 "$OUT/phases-$m.txt" 2>/dev/null; done
echo "--- benchmark summary"
grep "^| " "$OUT/BENCHMARKS-$DEVICE.md" 2>/dev/null | cut -d'|' -f2-8 | head -40
grep -A3 "(failed)" "$OUT/BENCHMARKS-$DEVICE.md" 2>/dev/null | head -20
echo "--- cpu ingest"
grep -E "^\| 1\. Ingest" "$OUT/BENCHMARKS-cpu-ingest.md" 2>/dev/null | head -5
echo "--- tests"
echo "$(grep -c '] PASSED ' "$OUT/tests.log") passed, $(grep -c '] SKIPPED ' "$OUT/tests.log") skipped"
grep -E "\] (FAILED|ERROR) |^(FAILED|ERROR) | passed| failed" "$OUT/tests.log" | cut -c1-200 | tail -45
