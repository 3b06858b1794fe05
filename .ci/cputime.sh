#!/usr/bin/env bash
# .ci/cputime.sh CMD...: run CMD and print the CPU seconds it and every process it started used, e.g.
#   bash .ci/cputime.sh python -m pytest tests/decode/test_speculative.py -p no:xdist -q
# The suite is CPU-bound on the 2-core CI machine (its wall time is about its CPU seconds / 2), so a test's
# cost is its CPU seconds, which other load on the machine changes little (wall time it changes a lot).
# `time` misses the ranks (a fork server's children are not the shell's); a cgroup of their own counts them.
# Needs a writable cgroup-v1 cpuacct hierarchy (root in a container, as here); otherwise runs CMD and says so.
set -u
root=/sys/fs/cgroup/cpuacct
g="$root/cputime_$$_$RANDOM"
if ! mkdir "$g" 2>/dev/null; then
    echo "cputime: cannot create a cgroup under $root: running without the count" >&2
    exec "$@"
fi
t0=$(date +%s.%N)
bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$g" "$@"
rc=$?
t1=$(date +%s.%N)
usage=$(cat "$g/cpuacct.usage")
python3 -c "print(f'cputime: {$usage / 1e9:.1f} cpu-s, {$t1 - $t0:.1f} wall-s, exit {$rc}')" >&2
rmdir "$g" 2>/dev/null || true  # a process still in it (a lingering fork server) keeps it: harmless
exit $rc
