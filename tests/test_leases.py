"""Leases: a poll's new records share one lease, which acks, nacks, extends and lapses
split; the held key tracks the ranges."""

from __future__ import annotations

import felix_redis

T, N, S, G = "acme", "prod", "jobs", "workers"


def test_a_poll_takes_one_lease_that_acks_nacks_and_lapses_split(client: felix_redis.Client) -> None:
    """A poll's new records share one lease: two members (the lease key's and the held
    key's) however many records it covers. A record leaving it (ack, nack, extend,
    lapse) splits it, the rest keeping the expiry; counts are per record; both keys go
    with the last lease, whichever way it ends."""
    client.stream_create(T, N, S)
    client.group_create(T, N, S, G)
    client.publish_batch(T, N, S, [b"x"] * 100)
    keys = client.group_keys(T, N, S, G)[0]
    lease, held = keys["lease"], keys["held"]
    raw = client.redis
    records = client.group_poll(T, N, S, 0, G, max_records=100)
    ((first, expiry),) = raw.zrange(lease, 0, -1, withscores=True)
    assert (first, raw.zrange(held, 0, -1, withscores=True)) == (b"0", [(b"0", 99.0)])
    assert client.group_describe(T, N, S, G).in_flight == 100
    assert client.group_ack_many(T, N, S, 0, G, records[10:20]) == [True] * 10
    client.group_nack(T, N, S, 0, G, records[50], delay=60)
    assert raw.zrange(held, 0, -1, withscores=True) == [(b"0", 9.0), (b"20", 49.0), (b"51", 99.0)]
    assert {s for _, s in raw.zrange(lease, 0, -1, withscores=True)} == {expiry}
    later = client.group_extend(T, N, S, 0, G, records[30], by=600)
    assert raw.zscore(lease, "30") == later and raw.zscore(held, "30") == 30
    assert raw.zrange(held, 0, -1, withscores=True) == [
        (b"0", 9.0), (b"20", 29.0), (b"30", 30.0), (b"31", 49.0), (b"51", 99.0)]
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (89, 1)
    # the lease of 51..99 lapses: the next poll takes its 49 records back, owed, and
    # hands them out again with the nacked one when due (here: 1 record per poll)
    raw.zadd(lease, {"51": 1}, xx=True)
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (40, 50)
    (again,) = client.group_poll(T, N, S, 0, G, max_records=1)
    assert (again.offset, again.attempts) == (51, 2)
    info = client.group_describe(T, N, S, G).shards[0]
    assert (info.in_flight, info.owed) == (41, 49)
    client.group_ack_many(T, N, S, 0, G, range(100))
    assert not raw.exists(lease) and not raw.exists(held)
    assert client.group_describe(T, N, S, G).shards[0].position == 100
