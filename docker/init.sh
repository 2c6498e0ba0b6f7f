#!/bin/sh
# One-shot quickstart set-up: create the queue "orders" and, while it is still
# empty, publish "hello" into it. Running it again changes nothing (creating a stream
# that exists with the same settings is a no-op, and the stream is no longer empty).
# Retries while Redis and the sentinels come up; gives up after FELIX_INIT_TRIES
# (default 60) one-second tries.
set -u
tries=0
until out=$(felixctl stream create orders --kind queue 2>&1); do
    tries=$((tries + 1))
    if [ "$tries" -ge "${FELIX_INIT_TRIES:-60}" ]; then
        echo "init: giving up: $out" >&2
        exit 1
    fi
    sleep 1
done
echo "init: $out"
tail=$(felixctl stream describe orders -o json | python3 -c '
import json, sys
print(sum(shard["tail"] for shard in json.load(sys.stdin)["shard_states"]))
') || exit 1
if [ "$tail" = 0 ]; then
    exec felixctl pub orders hello
fi
echo "init: orders holds $tail record(s) already; nothing published"
