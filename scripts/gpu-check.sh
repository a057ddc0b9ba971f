#!/usr/bin/env bash
# One GPU check for burn-ddp, in two halves:
#
#   scripts/gpu-check.sh build   # on a build machine (cargo; no GPU needed): builds the CUDA
#                                # binaries CI links, packs them into .gpu-bin/ (git-ignored)
#   scripts/gpu-check.sh run     # on a machine with an NVIDIA GPU (no network, no cargo):
#                                # finds libcuda and libnccl, runs every check, prints ONE table
#
# With this workplace's device tool, after `build` here:
#   run(command="bash scripts/gpu-check.sh run", carry=[".gpu-bin", ".gl"], timeout_s=540)
# (.gl holds the Vulkan loader that `build` downloads for the wgpu rows). The run half finishes
# within GPU_CHECK_BUDGET seconds (default 450) and skips what no longer fits. Without a GPU
# (a dry run on the build machine) every CUDA row fails with the no-driver error, as it must.
#
# What `build` registers lives in .gpu-bin/manifest.tsv, one check per line:
#   libtest<TAB>LABEL<TAB>BINARY            every #[ignore]d test of a libtest binary, one row each
#                                           (tests named two_gpus_* only with 2+ GPUs)
#   cmd<TAB>LABEL<TAB>TIMEOUT_S<TAB>COMMAND  a command; exit status 0 = pass
# Output a check prints from "BENCH |" or "OUTCOME" to the end of a line is shown under the table
# (libtest may print "test NAME ... " before it on the same line).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=.gpu-bin
MANIFEST=$BIN/manifest.tsv
# Where `run` unpacks the binaries (they don't fit the carry limit unpacked).
GPU_BIN=${GPU_CHECK_BIN_DIR:-/tmp/gpu-check-bin}
export GPU_BIN
# The features of CI's CUDA build (keep in step with xtask/src/ci.rs; `build` checks), so
# `build` reuses what `cargo xtask ci` compiled and packs the binaries CI linked.
CUDA_FEATURES="ddp-tests/wgpu,ddp-tests/cuda,train-cnn/wgpu,train-cnn/cuda"
CUDA_PACKAGES=(-p burn-ddp -p ddp-tests -p train-cnn)

die() { echo "gpu-check: $*" >&2; exit 2; }

# ------------------------------------------------------------------------------------------
# build half
# ------------------------------------------------------------------------------------------

# pick NAME KIND DEST: copies the executable of the last artifact named NAME of target kind
# KIND in cargo's JSON ($JSON) into the staging folder as DEST, stripped. KIND "bin" and
# "example" take the program, any other kind ("lib", "test") its test harness.
pick() {
  local exe
  exe=$(python3 -c '
import json, sys
want, kind = sys.argv[1], sys.argv[2]
harness = kind not in ("bin", "example")
found = ""
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == want \
            and kind in m["target"]["kind"] and m.get("executable") \
            and m["profile"]["test"] == harness:
        found = m["executable"]
print(found)
' "$1" "$2" <"$JSON")
  [ -n "$exe" ] || die "no $2 executable named $1 in cargo's output"
  cp "$exe" "$BIN/stage/$3"
  strip "$BIN/stage/$3" 2>/dev/null || true
}

# register_libtest LABEL FILE / register_cmd LABEL TIMEOUT_S COMMAND (run by `bash -c` from the
# repo root; $GPU_BIN is the folder of the unpacked binaries).
register_libtest() { printf 'libtest\t%s\t%s\n' "$1" "$2" >>"$MANIFEST"; }
register_cmd() { printf 'cmd\t%s\t%s\t%s\n' "$1" "$2" "$3" >>"$MANIFEST"; }

do_build() {
  command -v cargo >/dev/null || die "build needs cargo"
  command -v python3 >/dev/null || die "build needs python3 (to read cargo's JSON)"
  command -v xz >/dev/null || die "build needs xz"
  grep -q "\"$CUDA_FEATURES\"" xtask/src/ci.rs ||
    die "CUDA_FEATURES is out of step with xtask/src/ci.rs"
  local exclude
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
  if [ -n "$exclude" ] && ! grep -qx '/.gpu-bin/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo '/.gpu-bin/' >>"$exclude"
  fi
  rm -rf "$BIN"
  mkdir -p "$BIN/stage"
  : >"$MANIFEST"
  JSON=$BIN/cargo.json

  # CI's CUDA build (dev profile, optimised dependencies): CubeCL kernels on CUDA, NCCL on
  # device memory, and train-cnn, which also trains on wgpu and on the CPU.
  cargo test --no-run "${CUDA_PACKAGES[@]}" --tests --features "$CUDA_FEATURES" \
    --message-format=json >"$JSON"
  pick burn_ddp lib burn-ddp-tests
  pick sync_batch_norm test sync_batch_norm-tests
  pick ddp test ddp-tests
  pick ddp_worker bin ddp_worker
  pick syncbn_worker bin syncbn_worker
  pick train-cnn bin train-cnn
  # The NCCL transport's tests (no Burn); in release, for the benchmarks: ddprun, the
  # all-reduce benchmark and xtask (`xtask train --gpus 1 --program …` needs no cargo).
  cargo test --no-run -p ddp-comm --features nccl --test nccl --message-format=json >"$JSON"
  pick nccl test ddp-comm-nccl-tests
  cargo build --release -p ddprun -p ddp-comm --features ddprun/nccl,ddp-comm/nccl --bin ddprun \
    --example allreduce_bench --message-format=json >"$JSON"
  pick ddprun bin ddprun
  pick allreduce_bench example allreduce_bench
  cargo build --release -p xtask --message-format=json >"$JSON"
  pick xtask bin xtask
  cp scripts/gloo_allreduce.py "$BIN/stage/"
  rm -f "$JSON"

  # One archive with a dictionary larger than one binary: the CUDA binaries share LLVM and
  # Burn, which xz then stores about once.
  local raw
  raw=$(du -sb "$BIN/stage" | cut -f1)
  tar -C "$BIN/stage" -cf - . | xz -9 --lzma2=preset=9,dict=512MiB -T1 >"$BIN/bins.tar.xz"
  rm -rf "$BIN/stage"

  # Checks in order of importance (the run half skips what its time budget no longer fits).
  register_libtest "SyncBatchNorm on CUDA (kernels, NCCL, host-staged)" sync_batch_norm-tests
  register_libtest "burn-ddp on CUDA (NCCL device buffers, gradient path)" burn-ddp-tests
  register_cmd "train-cnn 1 epoch: cuda vs cpu, same seed" 240 \
    "bash scripts/gpu-check.sh compare-backends"
  register_cmd "DDP world of one via ddprun: NCCL gradients + SyncBatchNorm over NCCL" 180 \
    "bash scripts/gpu-check.sh ddprun-nccl"
  register_libtest "DDP equivalence on CUDA (1 GPU over NCCL, 2 ranks)" ddp-tests
  register_cmd "step time: cuda / wgpu / cpu; BatchNorm vs SyncBatchNorm" 300 \
    "bash scripts/gpu-check.sh step-times"
  register_libtest "ddp-comm NCCL transport" ddp-comm-nccl-tests
  register_cmd "cargo xtask train --gpus 1 (the xtask binary, --program)" 150 \
    "\$GPU_BIN/xtask train --gpus 1 --epochs 1 --program \$GPU_BIN/train-cnn --out /tmp/gpu-check-xtask -- --train-size 2000 --eval-size 500 --no-progress"
  register_cmd "CPU all-reduce scaling: 2, 4, 8 ranks (shm), gloo beside it" 200 \
    "bash scripts/gpu-check.sh cpu-scaling"

  # The Vulkan loader for the wgpu rows, as amd64 Debian packages in .gl/ (git-ignored; carry
  # it with .gpu-bin). The GPU machine has NVIDIA's Vulkan driver but maybe no loader.
  if ! compgen -G ".gl/*.deb" >/dev/null && command -v apt-get >/dev/null; then
    mkdir -p .gl /tmp/gpu-check-apt/partial
    local o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/gpu-check-apt)
    if apt-get "${o[@]}" update -qq >/dev/null 2>&1 &&
       (cd .gl && apt-get "${o[@]}" download -qq libvulkan1 >/dev/null 2>&1); then
      echo "gpu-check: Vulkan loader packages in .gl/: $(ls .gl)"
    else
      echo "gpu-check: could not download the Vulkan loader; the wgpu rows need one on the GPU machine" >&2
    fi
  fi

  local bytes
  bytes=$(du -sb "$BIN" | cut -f1)
  echo "gpu-check: $((raw / 1048576)) MiB of stripped binaries packed into $BIN/bins.tar.xz ($((bytes / 1048576)) MiB; the device tool carries 64 MiB in all)"
  cat "$MANIFEST"
  [ "$bytes" -lt $((60 * 1048576)) ] || echo "gpu-check: WARNING: $BIN is over 60 MiB" >&2
}

# ------------------------------------------------------------------------------------------
# checks that run through this script (on the GPU machine, after `run` unpacked GPU_BIN)
# ------------------------------------------------------------------------------------------

# train NAME FLAGS…: a short train-cnn run (give --epochs), output under /tmp/gpu-check-train/NAME.
train() {
  local name=$1
  shift
  "$GPU_BIN/train-cnn" --seed 7 --train-size 2000 --eval-size 500 --batch-size 32 \
    --no-progress --out "/tmp/gpu-check-train/$name" "$@"
}

# The CUDA run against the CPU run with the same seed: the losses after one epoch agree to 1e-3
# (relative); f32 sums in another order on each device keep them from agreeing bitwise.
compare_backends() {
  train cuda --backend cuda --sync-bn --epochs 1
  train cpu --backend cpu --sync-bn --epochs 1
  python3 "$ROOT/scripts/gpu_check_report.py" compare /tmp/gpu-check-train/cuda /tmp/gpu-check-train/cpu 1e-3
}

# DDP in a world of one under ddprun with DDP_NCCL=required: gradient buckets and SyncBatchNorm's
# statistics go through a one-rank NCCL communicator (the log line proves it was created).
ddprun_nccl() {
  local log=/tmp/gpu-check-ddprun.log
  DDP_NCCL=required RUST_LOG=burn_ddp=info "$GPU_BIN/ddprun" --nproc-per-node 1 -- \
    "$GPU_BIN/train-cnn" --backend cuda --sync-bn --epochs 1 --train-size 2000 --eval-size 500 \
    --no-progress --out /tmp/gpu-check-ddprun 2>&1 | tee "$log"
  grep -q 'one-rank NCCL communicator' "$log" || die "no NCCL communicator was created"
  echo "OUTCOME ddprun world of one: gradients and SyncBatchNorm statistics over NCCL"
}

# samples/s of epoch 2 (epoch 1 includes compiling the kernels) on each backend, and BatchNorm
# vs SyncBatchNorm on CUDA.
step_times() {
  local r
  for r in "cuda-bn --backend cuda" "cuda-syncbn --backend cuda --sync-bn" \
           "wgpu-syncbn --backend wgpu --sync-bn" "cpu-syncbn --backend cpu --sync-bn"; do
    # shellcheck disable=SC2086
    train $r --epochs 2 || echo "gpu-check: ${r%% *} failed" >&2
  done
  python3 "$ROOT/scripts/gpu_check_report.py" step-times /tmp/gpu-check-train 32
}

# ddp-comm's all-reduce over shared memory at 2, 4, 8 ranks, and PyTorch gloo beside it when
# this machine's Python has torch.
cpu_scaling() {
  local n
  for n in 2 4 8; do
    "$GPU_BIN/ddprun" --nproc-per-node "$n" --no-prefix -- "$GPU_BIN/allreduce_bench" \
      --sizes 1M,25M --transport shm |
      awk -v n="$n" '$1 ~ /^[0-9]/ { print "BENCH | ddp-comm shm, " n " ranks | " $0 }'
  done
  if python3 -c 'import torch.distributed' 2>/dev/null; then
    for n in 2 4 8; do
      python3 -m torch.distributed.run --nproc-per-node "$n" "$GPU_BIN/gloo_allreduce.py" \
        --sizes 1M,25M 2>/dev/null | grep '^BENCH' || echo "gpu-check: gloo at $n ranks failed" >&2
    done
  else
    echo "OUTCOME no torch on this machine: gloo not measured"
  fi
}

# ------------------------------------------------------------------------------------------
# run half
# ------------------------------------------------------------------------------------------

LOG_DIR=/tmp/gpu-check-logs
SUMMARY=()
NOTES=()
FAILED=0
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-450}

left() { echo $((BUDGET - ($(date +%s) - START))); }

row() { SUMMARY+=("$(printf '| %-58s | %-7s | %7s | %s |' "$1" "$2" "$3" "$4")"); }

# Prepends the folder of the first existing file among "$@" to LD_LIBRARY_PATH; prints it.
add_lib_dir() {
  local f
  for f in "$@"; do
    if [ -e "$f" ]; then
      local d
      d=$(dirname "$(readlink -f "$f")")
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "$d"
      return 0
    fi
  done
  return 1
}

setup_libraries() {
  # The Vulkan loader and friends, carried as Debian packages (device README), for wgpu checks.
  if compgen -G ".gl/*.deb" >/dev/null; then
    local f
    for f in .gl/*.deb; do
      dpkg -x "$f" / 2>/dev/null || echo "gpu-check: could not unpack $f; the wgpu rows may fail" >&2
    done
    ldconfig 2>/dev/null || true
  fi
  if [ -z "${VK_DRIVER_FILES:-}" ] && [ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi

  # libcuda.so.1 comes with the driver: on LD_LIBRARY_PATH, in the ldconfig cache, or in one of
  # the driver's usual folders (then added to LD_LIBRARY_PATH).
  CUDA_LIB=""
  local dir
  local ldp=${LD_LIBRARY_PATH:-}
  for dir in ${ldp//:/ }; do
    if [ -e "$dir/libcuda.so.1" ]; then CUDA_LIB="$dir/libcuda.so.1"; break; fi
  done
  [ -n "$CUDA_LIB" ] || CUDA_LIB=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  if [ -z "$CUDA_LIB" ]; then
    local d
    d=$(add_lib_dir /usr/local/nvidia/lib64/libcuda.so.1 /usr/local/nvidia/lib/libcuda.so.1 \
          /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 \
          /usr/local/cuda/compat/libcuda.so.1) || true
    CUDA_LIB=${d:+$d/libcuda.so.1}
  fi

  # libnccl.so.2 from Python's nvidia-nccl-cu12 / -cu13 wheel (or the system). cudarc 0.19
  # does not try the name libnccl.so.2, so link libnccl.so to it in a folder of our own.
  NCCL_LIB=""
  local py dirs
  for py in python3 python; do
    command -v "$py" >/dev/null || continue
    dirs=$("$py" - <<'EOF' 2>/dev/null || true
import os, site, sys
cands = []
try:
    import nvidia.nccl as m
    cands += [os.path.join(p, "lib") for p in m.__path__]
except Exception:
    pass
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    cands += [os.path.join(sp, "nvidia", "nccl", "lib"), os.path.join(sp, "nvidia", "cu13", "lib"),
              os.path.join(sp, "nvidia", "cu12", "lib")]
print("\n".join(cands))
EOF
)
    local d
    for d in $dirs; do
      if [ -e "$d/libnccl.so.2" ]; then NCCL_LIB="$d/libnccl.so.2"; break 2; fi
    done
  done
  if [ -z "$NCCL_LIB" ]; then
    # Any other layout of a wheel: search the nvidia/ folders of the site-packages.
    local sp
    for sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true); do
      [ -d "$sp/nvidia" ] || continue
      NCCL_LIB=$(find "$sp/nvidia" -maxdepth 4 -name 'libnccl.so.2' 2>/dev/null | head -n1)
      [ -z "$NCCL_LIB" ] || break
    done
  fi
  if [ -z "$NCCL_LIB" ]; then
    NCCL_LIB=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
  fi
  if [ -n "$NCCL_LIB" ]; then
    mkdir -p "$BIN/lib"
    ln -sf "$(readlink -f "$NCCL_LIB")" "$BIN/lib/libnccl.so"
    export LD_LIBRARY_PATH="$ROOT/$BIN/lib:$(dirname "$(readlink -f "$NCCL_LIB")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi

  # One node: NCCL's bootstrap and socket transport over loopback; warnings only.
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export RUST_BACKTRACE=${RUST_BACKTRACE:-0}
  # Few autotune candidates: kernels compile through LLVM in every process, and the check has
  # minutes. Ranks compiling at different speeds must not trip the collective timeout.
  export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
  export DDP_TIMEOUT_SECS=${DDP_TIMEOUT_SECS:-120}
  # Test binaries start the rank programs unpacked beside them (ddp_tests::BIN_DIR_VAR).
  export DDP_TESTS_BIN_DIR=$GPU_BIN
}

# Unpacks .gpu-bin/bins.tar.xz into $GPU_BIN with Python (xz may be missing there) and checks
# that every binary's libraries resolve.
unpack_binaries() {
  rm -rf "$GPU_BIN"
  mkdir -p "$GPU_BIN"
  python3 -c 'import lzma, sys, tarfile
with lzma.open(sys.argv[1]) as f, tarfile.open(fileobj=f, mode="r|") as t:
    t.extractall(sys.argv[2])' "$BIN/bins.tar.xz" "$GPU_BIN" || die "cannot unpack $BIN/bins.tar.xz"
  chmod +x "$GPU_BIN"/* 2>/dev/null || true
  local f missing
  for f in "$GPU_BIN"/*; do
    [ -x "$f" ] && [ ! -d "$f" ] || continue
    missing=$(ldd "$f" 2>&1 | grep -E 'not found|version .* not found' || true)
    if [ -n "$missing" ]; then
      NOTES+=("--- ldd $(basename "$f"): $missing")
    fi
  done
}

# The panic message of a failed check (or its last lines), cut to a readable width.
failure_excerpt() {
  if grep -q 'panicked at' "$1"; then
    grep -m1 -A4 'panicked at' "$1"
  else
    tail -n 10 "$1"
  fi | cut -c1-400
}

# Runs each #[ignore]d test of a libtest binary on its own, with a per-test timeout.
run_libtest() {
  local label=$1 bin=$GPU_BIN/$2
  if [ ! -x "$bin" ]; then
    row "$label" "MISSING" "-" "$bin not built (scripts/gpu-check.sh build)"
    FAILED=1
    return
  fi
  local names
  names=$("$bin" --list --ignored --format=terse 2>/dev/null | sed -n 's/: test$//p' | grep -v 'child_entry' || true)
  local name
  for name in $names; do
    if [[ $name == *two_gpus* ]] && [ "${GPU_COUNT:-0}" -lt 2 ]; then
      row "$label::$name" "SKIPPED" "-" "needs 2 CUDA devices ($GPU_COUNT visible)"
      continue
    fi
    local budget
    budget=$(left)
    if [ "$budget" -lt 20 ]; then
      row "$label::$name" "SKIPPED" "-" "time budget spent"
      continue
    fi
    local t=$((budget < 150 ? budget - 5 : 150))
    local log="$LOG_DIR/${label//\//_}__$name.log"
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    timeout -k 5 "$t" "$bin" --exact "$name" --ignored --test-threads=1 --nocapture >"$log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
    local status note
    case $rc in
      0) status=PASS; note=$(grep -m1 -o 'OUTCOME.*' "$log" | cut -c9- || true) ;;
      124|137) status=TIMEOUT; note="killed after ${t}s"; FAILED=1 ;;
      *) status=FAIL; FAILED=1
         note=$(grep -m1 -A1 'panicked at' "$log" | tail -n1 | cut -c1-120 || true) ;;
    esac
    row "$label::$name" "$status" "$secs" "$note"
    while IFS= read -r l; do NOTES+=("$l"); done < <(grep -oE '(BENCH \||OUTCOME).*' "$log" || true)
    if [ "$status" != PASS ]; then
      NOTES+=("--- $label::$name")
      while IFS= read -r l; do NOTES+=("    $l"); done < <(failure_excerpt "$log")
    fi
  done
}

run_cmd() {
  local label=$1 limit=$2 cmd=$3
  local budget
  budget=$(left)
  if [ "$budget" -lt 20 ]; then
    row "$label" "SKIPPED" "-" "time budget spent"
    return
  fi
  [ "$limit" -lt "$budget" ] || limit=$((budget - 5))
  local log="$LOG_DIR/${label//[^A-Za-z0-9_.-]/_}.log"
  local t0 t1 rc=0
  t0=$(date +%s.%N)
  timeout -k 5 "$limit" bash -c "$cmd" >"$log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  local secs status note=""
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  case $rc in
    0) status=PASS ;;
    124|137) status=TIMEOUT; note="killed after ${limit}s"; FAILED=1 ;;
    *) status=FAIL; note="exit $rc"; FAILED=1 ;;
  esac
  row "$label" "$status" "$secs" "$note"
  while IFS= read -r l; do NOTES+=("$l"); done < <(grep -oE '(BENCH \||OUTCOME).*' "$log" || true)
  if [ "$status" != PASS ]; then
    NOTES+=("--- $label")
    while IFS= read -r l; do NOTES+=("    $l"); done < <(failure_excerpt "$log")
  fi
}

do_run() {
  [ -s "$MANIFEST" ] || die "$MANIFEST missing: run 'scripts/gpu-check.sh build' on the build machine and carry .gpu-bin"
  [ -s "$BIN/bins.tar.xz" ] || die "$BIN/bins.tar.xz missing: run 'scripts/gpu-check.sh build' and carry .gpu-bin"
  mkdir -p "$LOG_DIR"
  setup_libraries
  unpack_binaries

  local gpu driver cuda_version nccl_version
  gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n1 || true)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)
  GPU_COUNT=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  cuda_version=$(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -n1 || true)
  nccl_version=$(basename "$(readlink -f "${NCCL_LIB:-none}")")

  while IFS=$'\t' read -r kind label a b; do
    case $kind in
      libtest) run_libtest "$label" "$a" ;;
      cmd) run_cmd "$label" "$a" "$b" ;;
      '') ;;
      *) row "$label" "FAIL" "-" "unknown manifest kind $kind"; FAILED=1 ;;
    esac
  done <"$MANIFEST"

  {
    echo
    echo "## burn-ddp GPU check ($(date -u +%FT%TZ), $(( $(date +%s) - START )) s)"
    echo "GPU: ${gpu:-none found by nvidia-smi} (${GPU_COUNT:-0} visible); driver ${driver:-?}; ${cuda_version:-CUDA version ?}"
    echo "libcuda: ${CUDA_LIB:-NOT FOUND}; libnccl: ${NCCL_LIB:-NOT FOUND} ($nccl_version)"
    echo "CUBECL_AUTOTUNE_LEVEL=$CUBECL_AUTOTUNE_LEVEL; binaries: CI's CUDA build (dev profile, optimised dependencies)"
    echo
    printf '| %-58s | %-7s | %7s | %s |\n' "check" "result" "seconds" "note"
    printf '|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..60})" "---------" "---------" "------"
    printf '%s\n' "${SUMMARY[@]}"
    if [ "${#NOTES[@]}" -gt 0 ]; then
      echo
      printf '%s\n' "${NOTES[@]}"
    fi
    echo
    if [ "$FAILED" = 0 ]; then echo "gpu-check: ALL PASSED"; else echo "gpu-check: FAILURES (logs in $LOG_DIR)"; fi
  } | tee "${OUT:-/tmp}/gpu-check-summary.md"
  if [ -n "${OUT:-}" ]; then
    # One file with every check's full output (the device tool returns at most 8 files).
    for f in "$LOG_DIR"/*.log; do
      [ -e "$f" ] || continue
      printf '\n===== %s =====\n' "$(basename "$f")"
      cat "$f"
    done >"$OUT/gpu-check-logs.txt"
  fi
  return "$FAILED"
}

case "${1:-}" in
  build) do_build ;;
  run) do_run ;;
  # Checks the manifest runs (on the GPU machine, from `run`).
  compare-backends) compare_backends ;;
  ddprun-nccl) ddprun_nccl ;;
  step-times) step_times ;;
  cpu-scaling) cpu_scaling ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
