"""Producers: the secret and per-shard sequences that make a publish land once however
often it is sent, the pool plain publishes borrow from, and what a producer does when a
send failed."""

from __future__ import annotations

import random
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from felix_redis.errors import ConnectionFailed, FelixError, NotReplicated, SequenceError
from felix_redis.plans import Eval, Plan, Sleep


def new_producer_secret() -> str:
    """A producer's secret: 128 random bits as 32 hex digits (``secrets``), made without
    a round trip. Only the client holds it; a shard knows the producer by a digest of it
    (:func:`felix_redis.keys.producer_field`), so no other client can act as this producer."""
    return secrets.token_hex(16)


@dataclass
class ProducerState:
    """Producer secret and the last sequence used per (stream, shard). ``local``: a
    producer of the plain publishes' pool (:class:`ProducerPool`)."""

    producer_id: str | None = None
    sequences: dict[tuple[str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: bool = False

    def reset(self) -> None:
        """Forget the secret: the next publish uses a new one, with sequences from 1."""
        self.producer_id = new_producer_secret() if self.local else None
        self.sequences.clear()


class ProducerPool:
    """Producers for plain publishes: each concurrent caller borrows its own, so one
    producer's sequences reach a shard in order without serialising the callers."""

    def __init__(self) -> None:
        self._free: list[ProducerState] = []

    def acquire(self) -> ProducerState:
        try:
            return self._free.pop()
        except IndexError:
            return ProducerState(new_producer_secret(), local=True)

    def release(self, state: ProducerState) -> None:
        self._free.append(state)

def after_failed_send(producer: ProducerState, op: Eval, exc: FelixError) -> Plan[Any]:
    """The rest of a producer's publish after its first send ``op`` failed with
    ``exc``: the reply of a second send, or the error. One plan at a time per producer."""
    try:
        if not isinstance(exc, ConnectionFailed):
            raise exc
        # Outcome unknown: one more try with the same sequence is answered from the
        # shard's memory if the first landed.
        yield Sleep(0.05 + random.random() * 0.1)
        return (yield op)
    except (ConnectionFailed, SequenceError, NotReplicated):
        # Unknown outcome (lost twice; or applied on the primary only, which a
        # failover may undo) or a sequence the shard refused: start over as a new
        # producer, so the next publish can neither hit a gap nor be mistaken for a
        # re-send of this one.
        producer.reset()
        raise
    except FelixError:
        # Refused before anything was written: the sequence is still free.
        raise
    except BaseException:
        # Cancelled with the outcome unknown.
        producer.reset()
        raise

