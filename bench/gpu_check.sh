#!/usr/bin/env bash
# The GPU check of issue 4: on a machine with NVIDIA GPUs, what a ckpt save blocks the
# training loop for, against the copy floor (one device-to-host copy of the state into pinned
# host buffers), at 1 GB and 8 GB of state per rank.
#
#   bash bench/gpu_check.sh              # from the repository root; ~5 min on one GPU
#   bash bench/gpu_check.sh --dry-run    # say what it would run, run nothing
#
# It runs bench/stall.py --device cuda (peers floor and ckpt, one rank per GPU, at most 2;
# nccl for the model, ckpt on its own gloo groups) once per size, and prints stall's table
# for each, then one summary: ckpt's blocking time, the floor's copy time and bandwidth.
# Results: bench/results/stall-cuda-<size>mb.json (replaced; the ones before stay in git).
#
# Python: the repository's .venv, made as `make setup` makes it (python3 -m venv .venv, the
# pinned torch, the package) if it is not there yet. PYTHON=/path/to/python uses another
# interpreter whose torch has CUDA (ckpt is taken from this checkout, not installed).
# Knobs (environment): SIZES_MB="1000 8000", SAVES=3 (timed saves per peer), CKPT_DIR (where
# checkpoints are written; default a fresh directory under /tmp, deleted afterwards).
set -euo pipefail

cd "$(dirname "$0")/.."
SIZES_MB=${SIZES_MB:-"1000 8000"}
SAVES=${SAVES:-3}
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

fail() {
    if [ "$DRY" = 1 ]; then echo "gpu_check: (dry run) would stop here: $*"; else echo "gpu_check: $*" >&2; exit 1; fi
}

# 1. A GPU and its driver.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    fail "nvidia-smi not found: this check needs a machine with an NVIDIA GPU and its driver"
elif ! nvidia-smi -L >/dev/null 2>&1; then
    fail "nvidia-smi found no usable GPU ($(nvidia-smi -L 2>&1 | head -1))"
else
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | sed 's/^/gpu_check: GPU /'
fi

# 2. Python with a CUDA build of torch.
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else
    PY=.venv/bin/python
    if [ ! -f .venv/.ready ]; then
        if [ "$DRY" = 1 ]; then
            echo "gpu_check: (dry run) would make .venv: make setup"
        elif command -v make >/dev/null 2>&1; then
            make setup
        else  # the Makefile's setup target, step by step
            python3 -m venv .venv
            .venv/bin/python -m pip install -q torch==2.13.0
            .venv/bin/python -m pip install -q -e '.[test,demo]'
            touch .venv/.ready
        fi
    fi
fi
CUDA_INFO="$PY not found"
if [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1; then
    CUDA_INFO=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())' 2>&1 | tail -n 1) \
        || CUDA_INFO="importing torch failed: $CUDA_INFO"
fi
read -r TORCH_VERSION TORCH_CUDA CUDA_OK NGPU _ <<<"$CUDA_INFO" || true
if [ "${CUDA_OK:-}" != "True" ]; then
    fail "$PY: torch.cuda.is_available() is not True ($CUDA_INFO). A CPU build of torch cannot run this check: use a CUDA build (PYTHON=... or a .venv with torch from the CUDA wheels)"
    NGPU=1
else
    echo "gpu_check: $PY: torch $TORCH_VERSION, CUDA $TORCH_CUDA, $NGPU GPU(s)"
fi
RANKS=$(( NGPU < 2 ? NGPU : 2 ))  # nccl needs one GPU per rank

# 3. Room for the checkpoints: stall keeps every save of a peer until the peer is done.
DIR=${CKPT_DIR:-}
CHECK_DIR=${DIR:-/tmp}
mkdir -p "$CHECK_DIR"
AVAIL_MB=$(df -Pm "$CHECK_DIR" | awk 'NR==2 {print $4}')
for size in $SIZES_MB; do
    NEED_MB=$(( size * RANKS * (SAVES + 1) * 11 / 10 ))
    if [ "$AVAIL_MB" -lt "$NEED_MB" ]; then
        fail "$CHECK_DIR has $AVAIL_MB MB free; $size MB per rank on $RANKS rank(s), $SAVES+1 saves, needs ~$NEED_MB MB (set CKPT_DIR, SAVES or SIZES_MB)"
    fi
done

# 4. The runs.
OUTS=()
for size in $SIZES_MB; do
    out=bench/results/stall-cuda-${size}mb.json
    interval=$(( size >= 4000 ? 10 : 3 ))  # seconds of training between saves: a save's write fits in it
    cmd=("$PY" bench/stall.py --device cuda --ranks "$RANKS" --size-mb "$size" --peers floor,ckpt
         --saves "$SAVES" --interval-s "$interval" --out "$out")
    [ -n "$DIR" ] && cmd+=(--dir "$DIR/stall-cuda-${size}mb")
    echo "gpu_check: ${cmd[*]}"
    if [ "$DRY" = 0 ]; then
        "${cmd[@]}" || echo "gpu_check: the $size MB run failed (exit code $?); see its output above" >&2
        [ -f "$out" ] && OUTS+=("$out")
    fi
done
[ "$DRY" = 1 ] && exit 0
[ "${#OUTS[@]}" -gt 0 ] || { echo "gpu_check: no run produced results" >&2; exit 1; }

# 5. The summary: ckpt's blocking time against the floor.
"$PY" - "${OUTS[@]}" <<'EOF'
import json, sys

print("\ngpu_check summary (medians over timed saves; each save: the slower rank)")
print(f"{'MB/rank':>8} {'floor copy ms':>14} {'floor GB/s':>11} {'ckpt blocking ms':>17} {'ckpt/floor':>11} {'ckpt commit s':>14}  gpu")
for path in sys.argv[1:]:
    res = json.load(open(path))
    cfg, rows = res["config"], {r["peer"]: r for r in res["rows"]}
    mb = cfg["state_mb_per_rank"]
    fl, ck = rows.get("floor", {}), rows.get("ckpt", {})
    if "error" in fl or "error" in ck or not fl or not ck:
        print(f"{mb:8.0f}  failed: floor {fl.get('error', 'ok')}; ckpt {ck.get('error', 'ok')}")
        continue
    f, c = fl["blocking_s"]["median"], ck["blocking_s"]["median"]
    print(f"{mb:8.0f} {f * 1e3:14.1f} {mb / 1e3 / f:11.1f} {c * 1e3:17.1f} {c / f:10.2f}x {ck['e2e_s']['median']:14.2f}  {cfg.get('gpu')}")
EOF
