#!/usr/bin/env bash
# Installs Debian's SLURM and munge where they are missing (root, apt), for the tests that
# run paratrain under a real SLURM (tests/distributed/test_real_slurm.py, paratrain/testing_slurm.py).
# Without root or apt, or if the install fails, it says so and those tests skip.
set -uo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm: needs root and apt-get; the SLURM tests will skip" >&2
    exit 0
fi
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }; then
    echo "install_slurm: apt-get could not install slurm-wlm and munge; the SLURM tests will skip" >&2
fi
exit 0
