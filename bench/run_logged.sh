#!/usr/bin/env bash
# Sourced by bench/scaling.sh and bench/dp_scaling.sh: `run NAME LIMIT CMD...` runs CMD under
# `timeout LIMIT`, its output in $OUT/$PREFIX$NAME.log, and echoes its JSON lines (or the
# log's tail) with the exit code and wall time; ONLY="a b" runs only those names.
run() {
    local name=$1 limit=$2
    shift 2
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
    echo "### $name: $*"
    local t0=$SECONDS
    local log="$OUT/${PREFIX:-}$name.log"
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    grep '^{' "$log" || tail -n 25 "$log"
    echo "### $name rc=$rc wall=$((SECONDS - t0))s"
}
