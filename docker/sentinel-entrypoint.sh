#!/bin/sh
# Start a sentinel from /etc/felix/sentinel.conf, keeping the state it wrote on
# earlier runs. SENTINEL_ANNOUNCE_HOSTNAME, when set, is the name other sentinels
# and clients reach this one by (its compose service name).
set -eu
conf=/data/sentinel.conf
if [ ! -s "$conf" ]; then
    cp /etc/felix/sentinel.conf "$conf"
    if [ -n "${SENTINEL_ANNOUNCE_HOSTNAME:-}" ]; then
        echo "sentinel announce-ip $SENTINEL_ANNOUNCE_HOSTNAME" >> "$conf"
    fi
fi
exec redis-server "$conf" --sentinel
