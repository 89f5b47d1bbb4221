#!/usr/bin/env bash
# The device stages of the GPU issues on a lent H100/H200: each call of the device tool runs `setup` and some
# of the stages below within its 10 minutes.
#
# Before the call, once, in the checkout the device tool sends (the lead's):
#   bash tools/gpu_wheels.sh            # cffi + pycparser wheels into .whl/ (git-ignored there)
# The call (the device tool's run):
#   command: bash tools/gpu_check.sh    carry: [".whl"]    timeout_s: 600
#   and a second one for the NVMe rows and the largest model:  bash tools/gpu_check.sh setup step-nvme largest
#   issue 38 (the offloaded step under the GPU's compute), two calls: the first above (setup tests step): the
#     cuda tests, then the stage 1 rows with the engine's per-step breakdown (what ran under backward and under
#     the next forward); then  bash tools/gpu_check.sh setup step-s3  (the stage 3 rows)
#   issue 39 (the sizes people offload for, against DeepSpeed), a call each (about 8, 6 and 8 minutes):
#     bash tools/gpu_check.sh setup hf-8b
#     bash tools/gpu_check.sh setup step-ds hf-14b
#     bash tools/gpu_check.sh setup hf-largest
#
# Stages (arguments pick them; none: setup tests fetch step):
#   setup    the wheels into /tmp/site (on PYTHONPATH), our C built in place (setup.py build_ext
#            --inplace: the machine's python3 is the one holding torch and Triton), the machine's
#            description                                         -> $OUT/env.txt, $OUT/setup.log
#   tests    pytest -m cuda over tests/offload/gpu: the Fetcher, the gather kernel on the GPU, the
#            registration, and the engine's equivalence tests (fp32, bf16, the delayed update) on
#            the GPU; then the whole of tests/offload/gpu (the CPU-side logic) -> $OUT/pytest.log
#   fetch    tools/bench/bench_fetch.py (H2D / D2H GB/s against the pinned peak, 1,000 x 64 KiB
#            batched against the copy_ loop, the measured batch threshold) -> $OUT/bench_fetch.md
#   step     tools/bench/step_gpu.py at ~1B, interleaved: torch, none, opt-cpu, opt-cpu-serial, opt-cpu-fwd,
#            opt-cpu-half (STEP_CONTENDERS overrides the list; opt-cpu-dpu, whose figure is known, is left out)
#            -> $OUT/step_gpu_1b.md (the run's log), $OUT/step_gpu_1b.table.md (the report)
#   step-s3  the same with torch, none, s3-param-cpu, s3-param-cpu-live25 (the overlapped step at stage 3),
#            opt-cpu-int8 (STEP_S3_CONTENDERS overrides) -> $OUT/step_gpu_1b_s3.md, $OUT/step_gpu_1b_s3.table.md
#   step-nvme  the same with torch, none, opt-nvme, s3-param-nvme (each NVMe step moves the 12 GB of
#            fp32 state both ways, seconds per step: fewer rounds) -> $OUT/step_gpu_1b_nvme.md
#   largest  tools/bench/step_gpu.py --largest: the most layers at dim 4096 that fit with
#            s3-param-cpu, one contender -> $OUT/step_gpu_largest.md
#   step-ds  step_gpu.py at ~1B: torch, none, opt-cpu, ds-z2-opt-cpu, s3-param-cpu, ds-z3-param-cpu (DeepSpeed's
#            rows alternating with ours) -> $OUT/step_gpu_ds.md
#   hf-8b, hf-14b  tools/bench/step_hf.py --model 8b / 14b: the Llama checkpoint written, ours with the
#            estimate's config, then DeepSpeed fitted to the node, 3 measured steps each -> $OUT/step_hf_8b.md, ...
#   hf-largest  step_hf.py --largest: the most layers at the 30b widths the estimate fits (90% of each memory),
#            ours, 3 steps of 8 x 4096 tokens -> $OUT/step_hf_largest.md
# The DeepSpeed stages put its wheels (.whl/deepspeed/, installed by setup into $SITE_DS) on their path only.
# Every stage has a time limit, cut to what is left before DEADLINE seconds (default 580, inside the
# tool's 600) have passed since the start: a hung or slow stage costs its limit, not the reports of
# the others. Each stage's exit status goes to $OUT/summary.txt; the script's status is that of the
# first stage that failed. Outside the device tool OUT may be any directory (default: a fresh one
# under /tmp). PY overrides python3.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
PY=${PY:-python3}
DEADLINE=${DEADLINE:-580}
SITE=${SITE:-/tmp/site}  # where the wheels are installed (on PYTHONPATH after setup)
SITE_DS=${SITE_DS:-/tmp/site-ds}  # DeepSpeed's, on the path of its stages only
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup tests fetch step)
summary="$OUT/summary.txt"
: >"$summary"
status=0

# limit_for LIMIT_S: LIMIT_S, or the seconds left before the deadline (less a margin) when fewer.
limit_for() {
  local left=$((DEADLINE - SECONDS - 5))
  echo $(($1 < left ? $1 : left))
}

# run_stage NAME LIMIT_S LOG COMMAND...: the command under `timeout`, its output to LOG and the terminal.
run_stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS rc left
  left=$(limit_for 100000)
  if [ "$left" -lt 15 ]; then
    echo "$name: skipped, ${left}s left before the deadline" | tee -a "$summary"
    [ "$status" != 0 ] || status=124
    return 124
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "$name: rc $rc in $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (timed out)')" | tee -a "$summary"
  [ "$rc" = 0 ] || [ "$status" != 0 ] || status=$rc
  return "$rc"
}

setup() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || return 1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "no .whl/ here: cffi must already be importable (see tools/gpu_wheels.sh)"
  fi
  $PY - <<'EOF' || return 1
import importlib
for name in ("cffi", "pycparser", "aiofiles", "prometheus_client", "rich", "numpy", "pytest", "torch", "triton"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # report every missing one, then fail below
        print(f"{name} MISSING: {exc}")
import cffi, torch  # noqa: E401  (the two the rest cannot do without)
EOF
  if compgen -G ".whl/deepspeed/*.whl" >/dev/null; then  # the peer's: a failure here skips its rows, no more
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DS" \
      .whl/deepspeed/*.whl && PYTHONPATH=$SITE_DS:$PYTHONPATH $PY -c "import deepspeed; print('deepspeed', \
deepspeed.__version__)" || echo "DeepSpeed does not install or import: its rows will be skipped"
  fi
  $PY setup.py -q build_ext --inplace || return 1
  $PY -c "from cpu_adam import resolve_isa; import swap; print('our C: built; CPU Adam path', resolve_isa(None).name)"
}

describe() {
  {
    date -u
    nvidia-smi || true
    $PY -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    echo "cpus $(nproc)"; free -g; df -h /tmp
  } >"$OUT/env.txt" 2>&1
}

for stage in "${stages[@]}"; do
  case "$stage" in
    setup)
      # in this shell, not a subshell: the PYTHONPATH it exports serves the stages after it
      t0=$SECONDS
      describe
      setup >"$OUT/setup.log" 2>&1
      rc=$?
      cat "$OUT/setup.log"
      echo "setup: rc $rc in $((SECONDS - t0)) s" | tee -a "$summary"
      [ "$rc" = 0 ] || { status=$rc; echo "setup failed: nothing else can run"; break; } ;;
    tests)
      # every test runs (no -x: one GPU session sees them all); pytest-timeout (in the image) caps each
      run_stage tests 240 "$OUT/pytest.log" $PY -m pytest -q -m cuda -rs tests/offload/gpu \
        -o cache_dir=/tmp/pytest-cache -o timeout=120
      # (the HF and DeepSpeed bench tests are CPU runs CI makes; here they would only spend the budget)
      run_stage tests-cpu-side 60 "$OUT/pytest.log" $PY -m pytest -q -m "not cuda" tests/offload/gpu \
        --ignore=tests/offload/gpu/test_step_hf.py --ignore=tests/offload/gpu/test_step_deepspeed.py \
        -o cache_dir=/tmp/pytest-cache ;;
    fetch)
      run_stage fetch 120 "$OUT/bench_fetch.md" $PY tools/bench/bench_fetch.py --rounds 5 ;;
    # The step benches stop measuring 30 s before their stage's limit and report what they measured.
    step)
      lim=$(limit_for 300)
      run_stage step "$lim" "$OUT/step_gpu_1b.md" $PY tools/bench/step_gpu.py --rounds 3 --steps-per-round 3 \
        --contenders ${STEP_CONTENDERS:-torch none opt-cpu opt-cpu-serial opt-cpu-fwd opt-cpu-half} --nvme-path /tmp \
        --budget-seconds $((lim - 30)) --out "$OUT/step_gpu_1b.table.md" ;;
    step-s3)
      lim=$(limit_for 360)
      run_stage step-s3 "$lim" "$OUT/step_gpu_1b_s3.md" $PY tools/bench/step_gpu.py --rounds 3 --steps-per-round 3 \
        --contenders ${STEP_S3_CONTENDERS:-torch none s3-param-cpu s3-param-cpu-live25 opt-cpu-int8} --nvme-path /tmp \
        --budget-seconds $((lim - 30)) --out "$OUT/step_gpu_1b_s3.table.md" ;;
    step-nvme)
      lim=$(limit_for 300)
      run_stage step-nvme "$lim" "$OUT/step_gpu_1b_nvme.md" $PY tools/bench/step_gpu.py --rounds 2 --steps-per-round 2 \
        --contenders torch none opt-nvme s3-param-nvme --nvme-path /tmp --budget-seconds $((lim - 30)) ;;
    largest)
      # dim 4096 as 7B-class models have; 70% of each memory planned: the tiers' host memory is all pinned
      lim=$(limit_for 400)
      run_stage largest "$lim" "$OUT/step_gpu_largest.md" $PY tools/bench/step_gpu.py --largest --rounds 1 \
        --steps-per-round 3 --contenders s3-param-cpu --dim 4096 --heads 32 --batch 4 --headroom 0.7 \
        --nvme-path /tmp --budget-seconds $((lim - 30)) ;;
    step-ds)
      lim=$(limit_for 330)
      PYTHONPATH=$SITE_DS:${PYTHONPATH:-} run_stage step-ds "$lim" "$OUT/step_gpu_ds.md" $PY tools/bench/step_gpu.py \
        --rounds 3 --steps-per-round 3 --contenders torch none opt-cpu ds-z2-opt-cpu s3-param-cpu ds-z3-param-cpu \
        --nvme-path /tmp --budget-seconds $((lim - 40)) --out "$OUT/step_gpu_ds.table.md" ;;
    hf-8b|hf-14b)
      lim=$(limit_for 540)
      PYTHONPATH=$SITE_DS:${PYTHONPATH:-} run_stage "$stage" "$lim" "$OUT/step_hf_${stage#hf-}.md" $PY \
        tools/bench/step_hf.py --model "${stage#hf-}" --contenders ours ds --steps 3 --nvme-path /tmp \
        --budget-seconds $((lim - 150)) --out "$OUT/step_hf_${stage#hf-}.table.md" ;;
    hf-largest)
      lim=$(limit_for 540)
      # one micro-batch of 8 x 4096 a step: the largest row keeps its accumulators on NVMe, read and written
      # at every micro-batch; 90% of each memory planned (the estimate is the engine's allocations, exactly)
      run_stage hf-largest "$lim" "$OUT/step_hf_largest.md" $PY tools/bench/step_hf.py --largest --contenders ours \
        --steps 3 --micro-batch 8 --accum 1 --headroom 0.9 --nvme-path /tmp --budget-seconds $((lim - 200)) \
        --out "$OUT/step_hf_largest.table.md" ;;
    *)
      echo "gpu_check: unknown stage $stage (setup tests fetch step step-s3 step-nvme largest step-ds hf-8b hf-14b hf-largest)" | tee -a "$summary"
      status=2 ;;
  esac
done
echo "gpu_check: done; reports in $OUT (status $status)"
cat "$summary"
exit "$status"
