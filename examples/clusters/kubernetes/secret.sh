#!/bin/sh
# The job's secret as the Kubernetes Secret dtrain-job (key: secret), in the current namespace:
# 32 random bytes, hex (dtrain asks for 16 characters or more). It never appears in a command
# line, which every user of the machine can read: kubectl reads it from a file of mode 0600.
set -eu
umask 077
file=$(mktemp)
trap 'rm -f "$file"' EXIT
od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$file"
kubectl create secret generic dtrain-job --from-file=secret="$file"
