#!/usr/bin/env bash
# The GPU checks and figures of the fused kernels, in one run that fits 10 minutes of GPU time.
#
# Run from the repository root where python has torch, triton, jax (with its CUDA plugin on a
# GPU), keras and dcmha installed:
#
#     bash benchmarks/gpu_check.sh [OUTPUT_DIR]          # default: $OUT, else benchmarks/out/gpu
#     DRY_RUN=1 bash benchmarks/gpu_check.sh [OUTPUT_DIR]  # on a CPU: interpreters, tiny shapes
#
# Steps (STEPS="..." runs a subset, in this order):
#   tests        the compiled Triton kernels on every case of tests/kernel_cases.GPU_CASES and
#                the DCMHA layer's "auto" (tests/backends/test_gpu_triton.py,
#                tests/backends/test_gpu_layer.py) against the NumPy spec; dry run: the same
#                kernels in Triton's interpreter
#                (tests/backends/test_triton_kernel.py, all terms + GQA + masks).
#   torch-core   benchmarks/gpu_timings.py: the fused Triton core, forward + backward, against
#                PyTorch SDPA (flash / cuDNN) at B*T = 8k-32k, N = 16-32, d = 128, bfloat16,
#                causal and windowed.
#   torch-layer  benchmarks/attention.py: one DCMHA layer's training step ("auto", "ops")
#                against keras.layers.MultiHeadAttention.
#   jax-core     as torch-core for the Pallas kernels against jax.nn.dot_product_attention
#                (cuDNN): off by default (STEPS adds it), the GPU budget holds one backend.
# Each step has a time limit; each writes JSON to OUTPUT_DIR, and the last writes
# OUTPUT_DIR/table.md from them. The exit status is the number of failed steps.
set -u
out=${1:-${OUT:-benchmarks/out/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_DEFAULT_FP_FUSION=1
failed=0
py=${PYTHON:-python3}
dry=${DRY_RUN:-0}

step() {   # step NAME LIMIT_SECONDS COMMAND... (a dry run allows 5x: interpreters are slow)
    local name=$1 limit=$2 t0 rc
    shift 2
    [ "$dry" = 1 ] && limit=$((limit * 5))
    t0=$(date +%s)
    echo "===== $name: $*"
    timeout "$limit" "$@" 2>&1
    rc=$?
    echo "===== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

if [ "$dry" = 1 ]; then
    echo "dry run: CPU, interpreters, tiny shapes (timings mean nothing)"
    core_args="--dry-run"
    layer_args="--batch 1 --length 32 --dim 64 --heads 4 --repeats 1 --warmup 1 --no-memory"
    triton_env="TRITON_INTERPRET=1"
    tests="tests/backends/test_triton_kernel.py -k all_terms"
else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    core_args="--repeats 5"
    layer_args="--batch 4 --length 2048 --dim 2048 --heads 16 --groups 2 --repeats 5 --no-memory"
    triton_env="TRITON_INTERPRET=0"
    tests="tests/backends/test_gpu_triton.py tests/backends/test_gpu_layer.py"
fi
"$py" - <<'EOF' | tee "$out/versions.json"
import importlib.metadata as md, json
v = {}
for n in ("torch", "triton", "jax", "jaxlib", "keras", "dcmha"):
    try:
        v[n] = md.version(n)
    except md.PackageNotFoundError:
        pass
print(json.dumps(v))
EOF

wanted=${STEPS:-"tests torch-core torch-layer"}
for s in $wanted; do
    case $s in
        tests) step $s 270 env $triton_env KERAS_BACKEND=torch "$py" -m pytest -q \
                   -p no:cacheprovider -rs --durations=5 --junitxml="$out/tests.xml" $tests ;;
        torch-core|jax-core) step $s 200 env KERAS_BACKEND=${s%-core} \
                   "$py" benchmarks/gpu_timings.py --backend ${s%-core} $core_args \
                   --json "$out/$s.json" ;;
        torch-layer|jax-layer) step $s 100 env $triton_env KERAS_BACKEND=${s%-layer} \
                   "$py" benchmarks/attention.py --implementations auto,ops $layer_args \
                   --no-gpu-core --json "$out/$s.json" ;;
        *) echo "unknown step $s"; failed=$((failed + 1)) ;;
    esac
done

"$py" - "$out" <<'EOF' | tee "$out/table.md"
import glob, json, os, sys
out = sys.argv[1]
print("| backend | B | T | N | d | window | DCMHA ms | vendor ms | vendor | DCMHA / vendor |")
print("|---|---|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(out, "*-core.json"))):
    for r in json.load(open(path))["rows"]:
        print(f"| {r['backend']} | {r['B']} | {r['T']} | {r['N']} | {r['d']} | {r['window']} "
              f"| {r['dcmha_ms']} | {r['vendor_ms']} | {r['vendor']} | {r['ratio']} |")
for path in sorted(glob.glob(os.path.join(out, "*-layer.json"))):
    print(f"\n{os.path.basename(path)}:")
    print(json.dumps(json.load(open(path)), indent=1)[:3000])
EOF
echo "===== $failed step(s) failed"
exit "$failed"
