#!/usr/bin/env bash
# The paper profile proven on a lent GPU (an H200) at the real shapes: random-weight bfloat16 checkpoints with the
# exact configs of Qwen2.5-VL-3B-Instruct and Llama-3.1-8B-Instruct, a few synthetic records per file in the
# paper profile's layout, then the profile's own kvbench commands in DAG order, mirroring
# workflow/rules/conduit.smk (conduit_cache), eval.smk (eval: CONDUIT Table 1 refresh runs full/reuse/conduit@0.1/
# prophetkv@0.1, ResidualKV Table III runs Full cache/SnapKV/OmniKV/ResidualKV) and residualkv.smk
# (rkv_codec_import of a random compressor in the authors' layout, a 2-step rkv_codec at 8,192 tokens) without
# Snakemake (not on the GPU machine): src/kvbench/gpu/paper.py. RANDOM WEIGHTS: wall time and memory are
# real, every score is meaningless; the CSV header says so. Under 8 minutes: the jobs stop at 400 s of budget
# (each capped, a job that would start with under 15 s left is skipped), the python step is cut at 450 s.
#
#   bash scripts/gpu_paper.sh                # on the GPU machine, from any directory; CSV under $OUT
#   bash scripts/gpu_paper.sh --device cpu   # dry run: the same architectures at tiny sizes, bf16 on the CPU
#
# Python and install: scripts/gpu_python.sh. Writes $OUT/gpu_paper_jobs.csv (one row per job: rule, command,
# exit status, wall s, peak CUDA memory allocated/reserved, score of each eval, log tail of a failed job),
# $OUT/gpu_paper_runs.tar.gz (job logs, metrics/config of each run, codec-train summary, checkpoint configs),
# $OUT/gpu_paper.log and $OUT/pip.log. The checkpoints, records and work directory go under GPU_PAPER_ROOT
# (default /tmp/kvbench-paper on the GPU, $OUT/root for the dry run; 24 GB on the GPU; it must not exist or be
# empty: an existing non-empty directory is refused), deleted at the end unless GPU_PAPER_KEEP=1.
set -euo pipefail
name=gpu_paper
source "$(dirname "$0")/gpu_python.sh"
case "${*:-}" in
    "") device=cuda root="${GPU_PAPER_ROOT:-/tmp/kvbench-paper}" limit=450 ;;
    "--device cpu") device=cpu root="${GPU_PAPER_ROOT:-$out/root}" limit=1500 ;;
    *) echo "$name: expected no argument or --device cpu, got: $*" >&2; exit 2 ;;
esac
root="$(realpath -m "$root")"
# The script writes random-weight checkpoints at the paper profile's paths under the root and deletes it at the end:
# never a directory that holds anything already (e.g. a real data root named by mistake).
if [ -e "$root" ] && { [ ! -d "$root" ] || [ -n "$(ls -A "$root")" ]; }; then
    echo "$name: GPU_PAPER_ROOT $root exists and is not an empty directory; name a new one (the script writes" \
         "random-weight checkpoints there and deletes it at the end)" >&2
    exit 2
fi
rc=0
timeout "$limit" "$py" -m kvbench.gpu.paper run --device "$device" --out "$out" --root "$root" 2>&1 \
    | tee -a "$out/$name.log" || rc=$?
if [ -d "$root/work" ]; then
    (cd "$root" && find work/logs work/results work/codecs checkpoints -maxdepth 8 \
        \( -name '*.log' -o -name '*.stats.jsonl' -o -name metrics.json -o -name run_info.json -o -name config.yaml \
           -o -name summary.json -o -name curves.csv -o -name provenance.json -o -name codec.json \
           -o -name config.json -o -name kvbench_random_weights.json \) -print0 2>/dev/null \
        | tar --null -czf "$out/gpu_paper_runs.tar.gz" -T -) || echo "$name: could not pack the run files"
fi
[ "${GPU_PAPER_KEEP:-0}" = 1 ] || rm -rf "$root"
exit "$rc"
