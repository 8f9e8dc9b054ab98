#!/usr/bin/env bash
# Runs one batchgen job from cron: one run at a time per OUTPUT (flock), everything into a log file,
# and batchgen's exit code passed on (0 done, 2 usage, 65 rows failed with --strict, 75 interrupted:
# the next run resumes, 1 other failure). A run that finds the previous one still going exits 0.
#
#   crontab:  0 * * * *  /opt/batchgen/jobs/cron.sh /opt/batchgen/jobs/example.env
#
# The job is idempotent: a rerun resumes an unfinished OUTPUT, and does nothing if OUTPUT is complete.
set -euo pipefail

config=${1:?usage: cron.sh CONFIG   (see jobs/example.env)}
set -a  # every variable the config sets is exported: BATCHGEN_* reach batchgen as its options
# shellcheck disable=SC1090
source "$config"
set +a
: "${JOB_INPUT:?$config must set JOB_INPUT}" "${JOB_OUTPUT:?$config must set JOB_OUTPUT}"
log=${JOB_LOG:-$JOB_OUTPUT.log}
bin=${BATCHGEN_BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/batchgen}
mkdir -p "$(dirname "$log")" "$(dirname "$JOB_OUTPUT")"

stamp() { date '+%Y-%m-%d %H:%M:%S'; }

exec 9>"$JOB_OUTPUT.cron.lock"
if ! flock -n 9; then
    echo "$(stamp) cron.sh: the previous run for $JOB_OUTPUT is still going; not starting another" >> "$log"
    exit 0
fi

echo "$(stamp) cron.sh: $bin run $JOB_INPUT $JOB_OUTPUT" >> "$log"
rc=0
"$bin" run "$JOB_INPUT" "$JOB_OUTPUT" < /dev/null >> "$log" 2>&1 || rc=$?
case $rc in
    0) what="done" ;;
    2) what="usage error: check $config" ;;
    65) what="done, but some rows failed (--strict)" ;;
    75) what="interrupted; the next run resumes" ;;
    *) what="failed" ;;
esac
echo "$(stamp) cron.sh: exit $rc ($what)" >> "$log"
exit "$rc"
