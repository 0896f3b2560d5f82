"""The partition of a record's key, chosen as kafka-python's default partitioner
chooses it, for a whole batch of keys at once.

The relay sends every record with its partition given (``send(partition=...)``).
Left to kafka-python, each record's partition is chosen by its
``DefaultPartitioner``: a pure-Python murmur2 of the key and a sorted copy of the
topic's partitions, about 9.5 µs a record here, a sixth of what the relay's
process spends per event, all of it on the sending thread. Hashed here with numpy,
a claimed batch's keys cost about 0.2 µs each, on the claimer's thread
(docs/history/performance-notes.md#partitions-chosen-a-batch-at-a-time-7-december).

The choice must stay exactly kafka-python's (and the Java client's): murmur2 of
the key's bytes with Kafka's seed, its sign bit cleared, modulo the number of
the topic's partitions, indexing them in order. A deal's events then land on the
partition a previous release (or any other Kafka client) puts them on, so their
order holds across a deploy. ``tests/test_partitions.py`` checks the hash against
kafka-python's own ``murmur2``, and the relay's records against the partitions
kafka-python chooses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kafka import KafkaProducer

_SEED = 0x9747B28C
_M = np.uint32(0x5BD1E995)
_POSITIVE = np.uint32(0x7FFFFFFF)


def key_hashes(keys: Sequence[bytes]) -> list[int]:
    """Kafka's murmur2 of each key with its sign bit cleared, in the keys' order.

    Keys of one length are hashed as the rows of one matrix: murmur2 reads a key
    four bytes at a time, so a batch takes one vector operation per step where a
    key alone takes one Python operation. numpy's uint32 arithmetic wraps around,
    which is murmur2's own 32-bit arithmetic."""
    out = np.empty(len(keys), dtype=np.uint32)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    for length, positions in by_length.items():
        octets = np.frombuffer(b"".join(keys[i] for i in positions), dtype=np.uint8)
        octets = octets.reshape(len(positions), length)
        h = np.full(len(positions), _SEED ^ length, dtype=np.uint32)
        words = length // 4
        if words:
            # little-endian, as murmur2 reads them
            blocks = np.ascontiguousarray(octets[:, : words * 4]).view("<u4")
            for j in range(words):
                k = blocks[:, j] * _M
                k ^= k >> np.uint32(24)
                k *= _M
                h *= _M
                h ^= k
        tail = words * 4
        rest = length - tail
        if rest >= 3:
            h ^= octets[:, tail + 2].astype(np.uint32) << np.uint32(16)
        if rest >= 2:
            h ^= octets[:, tail + 1].astype(np.uint32) << np.uint32(8)
        if rest >= 1:
            h ^= octets[:, tail].astype(np.uint32)
            h *= _M
        h ^= h >> np.uint32(13)
        h *= _M
        h ^= h >> np.uint32(15)
        out[positions] = h & _POSITIVE
    return out.tolist()


class Partitions:
    """The partitions of the topics one round sends to, each read from the producer
    once, in the order the default partitioner indexes them (sorted)."""

    def __init__(self, producer: KafkaProducer) -> None:
        self.producer = producer
        self._topics: dict[str, list[int]] = {}

    def of(self, topic: str, key_hash: int) -> int:
        """The partition of a key hashed by ``key_hashes``. The topic's partitions
        come from kafka-python's metadata (``partitions_for``): known, they are read
        at once; unknown, it waits for them up to ``max_block_ms`` and raises as
        ``send`` does."""
        partitions = self._topics.get(topic)
        if partitions is None:
            partitions = self._topics[topic] = sorted(self.producer.partitions_for(topic))
        return partitions[key_hash % len(partitions)]
