#!/usr/bin/env bash
# CONDUIT Table 3 on a lent GPU (an H200): a random-weight timing model with Qwen2.5-VL-3B's exact text decoder
# (timing-qwen2.5-vl-3b, bfloat16) at the paper's 4k/8k/16k contexts (docpages requests of 16/32/64 pages of
# 448 px), full prefill vs every Table 3 method at r = 0.10, plus the authors' as-run CONDUIT Phase 2
# (conduit:phase2_text=query). Random weights give true FLOPs, time and memory, not answers; the table header
# says so. Under 8 minutes: the timing step is cut at 420 s (3 timed repeats after 1 warm-up).
#
#   bash scripts/gpu_table3.sh                # on the GPU machine, from any directory; CSVs under $OUT
#   bash scripts/gpu_table3.sh --device cpu   # dry run on tiny shapes (test timing model, 1 and 2 pages of 56 px)
#
# Python and install: scripts/gpu_python.sh. Writes $OUT/table3_raw_<cuda|cpu>.csv (one row per context, method
# and repeat), $OUT/table3_<cuda|cpu>.csv (the table, `kvbench report conduit/table3`), $OUT/gpu_table3.log and
# $OUT/pip.log; the tokenizer the timing model takes its vocabulary from is built under $OUT/tokenizer.
set -euo pipefail
name=gpu_table3
source "$(dirname "$0")/gpu_python.sh"
device=cuda model=timing-qwen2.5-vl-3b sizes=(16 32 64) px=448
case "${*:-}" in
    "") ;;
    "--device cpu") device=cpu model=timing-qwen2.5-vl-test sizes=(1 2) px=56 ;;
    *) echo "$name: expected no argument or --device cpu, got: $*" >&2; exit 2 ;;
esac
raw="$out/table3_raw_$device.csv"
[ -f "$out/tokenizer/tokenizer.json" ] || "$py" -m kvbench.cli tokenizer --out "$out/tokenizer" --vocab-size 4096 \
    >>"$out/$name.log" 2>&1
timeout 420 "$py" -m kvbench.cli bench conduit-latency --out "$raw" --model "$model" --tokenizer "$out/tokenizer" \
    --sizes "${sizes[@]}" --page-px "$px" --r 0.1 --repeats 3 --warmup 1 --device "$device" \
    --methods reuse cacheblend mpic kvshare-conduit prophetkv conduit conduit:phase2_text=query 2>&1 | tee -a "$out/$name.log"
"$py" -m kvbench.cli report conduit/table3 --spec "{\"profile\": \"gpu\", \"raw\": \"$raw\"}" \
    --out "$out/table3_$device.csv" 2>&1 | tee -a "$out/$name.log"
"$py" - "$out/table3_$device.csv" <<'PY' | tee -a "$out/$name.log"
import sys, pandas as pd
t = pd.read_csv(sys.argv[1], comment="#")
cols = ["method", "pages", "context_tokens", "ttft_ms_median", "speedup", "pct_of_full_flops", "scoring_pct_of_ttft",
        "flop_bound_share"]
print(t[cols].to_string(index=False))
PY
