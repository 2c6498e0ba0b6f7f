#!/bin/sh
# One-shot quickstart set-up: create the stream "orders" and publish "hello" once.
# A later run finds the stream and publishes nothing. Retries while Redis and the
# sentinels come up; gives up after FELIX_INIT_TRIES (default 60) one-second tries.
set -u
tries=0
while :; do
    if out=$(felixctl stream create orders --kind queue 2>&1); then
        echo "init: created stream orders"
        exec felixctl pub orders hello
    fi
    case "$out" in
        *xist*) echo "init: stream orders exists already"; exit 0 ;;
    esac
    tries=$((tries + 1))
    if [ "$tries" -ge "${FELIX_INIT_TRIES:-60}" ]; then
        echo "init: giving up: $out" >&2
        exit 1
    fi
    sleep 1
done
