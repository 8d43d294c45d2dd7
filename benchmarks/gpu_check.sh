#!/usr/bin/env bash
# The GPU checks and figures of benchmarks/RESULTS.md ("GPU figures"), in one run.
#
# Run from the repository root on a CUDA machine where python has torch, triton, jax with its
# CUDA plugin, keras and dcmha installed:
#
#     bash benchmarks/gpu_check.sh [OUTPUT_DIR]      # default: benchmarks/out/gpu
#
# 1. The compiled kernels against the NumPy spec (tests/test_gpu_*.py), one process per
#    backend: Triton (torch), Pallas (jax), and the DCMHA layer's "auto" on each.
# 2. benchmarks/attention.py: the fused cores vs the vendor's flash attention (B=4, T=4096,
#    N=32, d=128, bfloat16, causal) for several tile sizes, and one layer's forward and
#    training step ("auto" and "ops" vs keras MultiHeadAttention) with device peak memory.
# Each step has a time limit; the JSON results go to OUTPUT_DIR. Compiling dominates: on an
# H200 (triton 3.6, jax 0.11.2) each GPU_CASES case took ~37 s under Triton and ~24 s under
# Pallas, so the two test steps alone need most of a 15-minute device lease; run them in
# separate leases, or select cases with pytest's -k when rerunning part of them. STEPS="torch-core jax-core"
# (say) runs only those steps, of: triton-tests pallas-tests torch-core jax-core torch-layer
# jax-layer.
set -u
out=${1:-${OUT:-benchmarks/out/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
failed=0
py=${PYTHON:-python3}

step() {   # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "===== $name: $*"
    timeout "$limit" "$@" 2>&1
    rc=$?
    echo "===== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$py" - <<'EOF'
import importlib.metadata as md
print({n: md.version(n) for n in ("torch", "triton", "jax", "jaxlib", "keras", "dcmha")})
EOF

tests="-q -p no:cacheprovider -rs --durations=5"
core="--gpu-core-only --groups 4 --repeats 5 --core-blocks 16x16,32x32,64x32"
wanted=${STEPS:-"triton-tests pallas-tests torch-core jax-core torch-layer jax-layer"}
for s in $wanted; do
    case $s in
        triton-tests) step $s 480 env KERAS_BACKEND=torch "$py" -m pytest $tests \
                          tests/test_gpu_triton.py tests/test_gpu_layer.py ;;
        pallas-tests) step $s 420 env KERAS_BACKEND=jax "$py" -m pytest $tests \
                          tests/test_gpu_pallas.py tests/test_gpu_layer.py ;;
        torch-core|jax-core) step $s 300 env KERAS_BACKEND=${s%-core} \
                          "$py" benchmarks/attention.py $core --json "$out/$s.json" ;;
        torch-layer|jax-layer) step $s 150 env KERAS_BACKEND=${s%-layer} \
                          "$py" benchmarks/attention.py --implementations auto,ops --repeats 5 \
                          --no-gpu-core --json "$out/$s.json" ;;
        *) echo "unknown step $s"; failed=$((failed + 1)) ;;
    esac
done
echo "===== $failed step(s) failed"
exit "$failed"
