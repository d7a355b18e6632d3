#!/usr/bin/env bash
# The plots of docs/command_line.md (docs/img/): three short runs of the MLP on digits, from the
# recipes (allreduce, ps-sync, ps-async; 2 workers each, 5 epochs), then paratrain report.
#
#   bash benchmarks/report_example.sh [OUT_DIR]      # default docs/img
#
# Runs on a laptop's CPU in about a minute; the numbers depend on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/img}"
python="${PYTHON:-.venv/bin/python}"
runs="benchmarks/results/report_example"
mkdir -p "$runs" "$out"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
for recipe in digits_allreduce digits_ps_sync digits_ps_async; do
    "$python" -m paratrain train --config "recipes/$recipe.toml" --epochs 5 --no-progress --log-every 0 \
        --metrics-out "$runs/$recipe.json"
done
"$python" -m paratrain report "$runs"/digits_allreduce.json "$runs"/digits_ps_sync.json "$runs"/digits_ps_async.json \
    --out "$out"
