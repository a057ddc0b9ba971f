#!/usr/bin/env bash
# One GPU check for burn-ddp, in two halves:
#
#   scripts/gpu-check.sh build   # on a build machine (cargo, crates.io; no GPU needed):
#                                # builds the GPU test binaries into .gpu-bin/ (git-ignored)
#   scripts/gpu-check.sh run     # on a machine with one NVIDIA GPU (no network, no cargo):
#                                # finds libcuda and libnccl, runs every check, prints ONE table
#
# With this workplace's device tool, after `build` here:
#   run(command="bash scripts/gpu-check.sh run", carry=[".gpu-bin", ".gl"], timeout_s=540)
# (.gl holds the Vulkan loader that `build` downloads for the wgpu checks). The run half finishes
# within GPU_CHECK_BUDGET seconds (default 450) and skips what no longer fits.
#
# What `build` registers lives in .gpu-bin/manifest.tsv, one check per line:
#   libtest<TAB>LABEL<TAB>BINARY            every #[ignore]d test of a libtest binary, one row each
#   cmd<TAB>LABEL<TAB>TIMEOUT_S<TAB>COMMAND  a command; exit status 0 = pass
# Output a check prints from "BENCH |" or "OUTCOME" to the end of a line is shown under the table
# (libtest may print "test NAME ... " before it on the same line).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=.gpu-bin
MANIFEST=$BIN/manifest.tsv

die() { echo "gpu-check: $*" >&2; exit 2; }

# ------------------------------------------------------------------------------------------
# build half
# ------------------------------------------------------------------------------------------

# artifact NAME KIND: reads cargo's --message-format=json on stdin and prints the executable of
# the last artifact named NAME whose target kinds include KIND ("test" or "bin").
artifact() {
  python3 -c '
import json, sys
want, kind = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == want \
            and kind in m["target"]["kind"] and m.get("executable"):
        print(m["executable"])
' "$1" "$2" | tail -n1
}

# build_test PACKAGE TEST [CARGO ARGS...]: builds integration test TEST of PACKAGE in release
# mode and registers its ignored tests.
build_test() {
  local pkg=$1 test=$2; shift 2
  local exe
  exe=$(cargo test -p "$pkg" --release --no-run --test "$test" --message-format=json "$@" \
        | artifact "$test" test)
  [ -n "$exe" ] || die "no test executable for $pkg --test $test"
  local dst="$BIN/${pkg}-${test}-tests"
  cp "$exe" "$dst"
  strip --strip-debug "$dst" 2>/dev/null || true
  printf 'libtest\t%s\t%s\n' "$pkg/$test" "$dst" >>"$MANIFEST"
}

# build_bin PACKAGE BIN [CARGO ARGS...]: builds a binary in release mode into .gpu-bin/.
build_bin() {
  local pkg=$1 bin=$2; shift 2
  local exe
  exe=$(cargo build -p "$pkg" --release --bin "$bin" --message-format=json "$@" \
        | artifact "$bin" bin)
  [ -n "$exe" ] || die "no binary $bin in $pkg"
  cp "$exe" "$BIN/$bin"
  strip --strip-debug "$BIN/$bin" 2>/dev/null || true
}

# register_cmd LABEL TIMEOUT_S COMMAND: a check run as `bash -c COMMAND` from the repo root.
register_cmd() {
  printf 'cmd\t%s\t%s\t%s\n' "$1" "$2" "$3" >>"$MANIFEST"
}

do_build() {
  command -v cargo >/dev/null || die "build needs cargo"
  local exclude
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
  if [ -n "$exclude" ] && ! grep -qx '/.gpu-bin/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo '/.gpu-bin/' >>"$exclude"
  fi
  rm -rf "$BIN"
  mkdir -p "$BIN"
  : >"$MANIFEST"

  # NCCL transport: world size 1 on device buffers, raw pointers, the init watchdog, two
  # processes on one GPU (crates/ddp-comm/tests/nccl.rs).
  build_test ddp-comm nccl --features nccl

  # ---- EXTRA CHECKS: other crates add their lines here (see docs/gpu.md) -------------------
  # SyncBatchNorm CubeCL kernels through wgpu on NVIDIA's Vulkan driver: kernels and tensor ops
  # against Burn's BatchNorm (exit 1 above 1e-4 relative), then BatchNorm vs SyncBatchNorm
  # timings there. The binary is stripped and gzipped to fit the carry limit. Needs the Vulkan
  # loader on the GPU machine: carry ".gl" (device README) — `run` unpacks it.
  build_bin ddp-tests syncbn_bench --features wgpu
  strip "$BIN/syncbn_bench" 2>/dev/null || true
  gzip -9f "$BIN/syncbn_bench"
  register_cmd "SyncBatchNorm kernels vs BatchNorm on the GPU (wgpu/Vulkan)" 240 \
    "set -o pipefail; gunzip -c .gpu-bin/syncbn_bench.gz >/tmp/syncbn_bench && chmod +x /tmp/syncbn_bench && /tmp/syncbn_bench --ranks 0 --steps 10 --batches 8,32,64 2>&1 | sed 's/^|/BENCH |/'"
  #
  # 2-rank DDP equivalence sharing the one GPU over the host-staged path (wgpu on NVIDIA's
  # Vulkan driver): 2 ranks × batch 4 with Adam vs one process × batch 8 from the same weights,
  # ranks bitwise identical after every step, max |Δparam| ≤ 1e-5.
  build_bin ddp-comm ddprun
  strip "$BIN/ddprun" 2>/dev/null || true
  build_bin ddp-tests ddp_worker --features wgpu
  strip "$BIN/ddp_worker" 2>/dev/null || true
  gzip -9f "$BIN/ddp_worker"
  register_cmd "DDP 2 ranks sharing the GPU (wgpu, host-staged) = 1 process" 240 \
    "gunzip -c .gpu-bin/ddp_worker.gz >/tmp/ddp_worker && chmod +x /tmp/ddp_worker && .gpu-bin/ddprun --nproc-per-node 2 -- /tmp/ddp_worker --scenario equiv --optim adam --device wgpu --check 1e-5 --out /tmp/gpu-check-ddp"
  # -----------------------------------------------------------------------------------------

  # The Vulkan loader for the wgpu checks, as amd64 Debian packages in .gl/ (git-ignored; carry
  # it with .gpu-bin). The GPU machine has NVIDIA's Vulkan driver but maybe no loader.
  if ! compgen -G ".gl/*.deb" >/dev/null && command -v apt-get >/dev/null; then
    mkdir -p .gl /tmp/gpu-check-apt/partial
    local o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/gpu-check-apt)
    if apt-get "${o[@]}" update -qq >/dev/null 2>&1 &&
       (cd .gl && apt-get "${o[@]}" download -qq libvulkan1 >/dev/null 2>&1); then
      echo "gpu-check: Vulkan loader packages in .gl/: $(ls .gl)"
    else
      echo "gpu-check: could not download the Vulkan loader; the wgpu checks need one on the GPU machine" >&2
    fi
  fi

  local bytes
  bytes=$(du -sb "$BIN" | cut -f1)
  echo "gpu-check: built into $BIN/ ($((bytes / 1048576)) MiB; the device tool carries 64 MiB in all):"
  ls -l "$BIN"
  cat "$MANIFEST"
  [ "$bytes" -lt $((60 * 1048576)) ] || echo "gpu-check: WARNING: $BIN is over 60 MiB" >&2
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
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig || true
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
  local label=$1 bin=$2
  if [ ! -x "$bin" ]; then
    row "$label" "MISSING" "-" "$bin not built (scripts/gpu-check.sh build)"
    FAILED=1
    return
  fi
  local names
  names=$("$bin" --list --ignored --format=terse 2>/dev/null | sed -n 's/: test$//p' | grep -v 'child_entry' || true)
  local name
  for name in $names; do
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
  mkdir -p "$LOG_DIR"
  setup_libraries

  local gpu driver
  gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n1 || true)
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 || true)

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
    echo "GPU: ${gpu:-none found by nvidia-smi}; driver ${driver:-?}"
    echo "libcuda: ${CUDA_LIB:-NOT FOUND}; libnccl: ${NCCL_LIB:-NOT FOUND}"
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
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
