"""kafka-python alone, in a process of its own: the relay figure's baseline.

    python -m bench.kafka_alone DATABASE_URL BOOTSTRAP TOPIC COUNT [--partitions-given]

Sends the first ``COUNT`` of the bench's written events (``bench.outbox_written``,
what ``bench.relay.fresh_backlog`` writes into the outbox) as the relay sends them
(key, value, the four headers), with the relay's producer settings, then one
flush; prints one JSON line: ``{"events": n, "per_s": rate}``.

As it comes, kafka-python chooses each record's partition itself (its
``DefaultPartitioner``, per record, in pure Python): the relay's baseline. With
``--partitions-given`` it sends them as the relay does instead: a batch's keys
hashed at once (``reaper.partitions``), each record's partition given to
``send``; the bench prints the relay against that too, for the record.

It is a process of its own for the same reasons ``reaper relay --once`` is one,
and set up the same way: what a new process costs (imports, kafka-python's
first use of its protocol classes, the first connection to the partition's
leader) is in both clocks or in neither. Its start-up, its producer's connection
and the topic's metadata are before the clock, as the relay's are; so is a
``gc.freeze()`` of everything it holds, the records included: the relay holds
two batches' rows at most, this baseline holds all of them, and the collector
walking them would slow the baseline, not the relay. Measured in the bench's own
process instead (until 6 December), after its in-process drains, kafka-python
alone sent 50,000 events at 12,910-14,460 events/s where a process of its own
sends them at 21,665-22,521; at 5,000 it ran in a warm process where the relay
never does
(docs/history/performance-notes.md#kafka-python-alone-in-a-process-of-its-own-6-december-late).
"""

from __future__ import annotations

import gc
import json
import sys
import time

from kafka import KafkaProducer

from bench.relay import Record, records, relay_settings
from reaper.kafka import producer_config
from reaper.partitions import Partitions, key_hashes


def rate(url: str, bootstrap: str, topic: str, count: int, partitions_given: bool) -> float:
    recs = records(url, count)
    if len(recs) != count:
        raise RuntimeError(f"{len(recs)} written events to send, wanted {count}")
    settings = relay_settings(url, bootstrap, topic)
    producer = KafkaProducer(**producer_config(settings))
    try:
        producer.partitions_for(topic)  # metadata before the clock starts
        gc.freeze()
        started = time.perf_counter()
        if partitions_given:
            send_as_the_relay(producer, topic, recs, settings.relay_batch_size)
        else:
            for key, value, headers in recs:
                producer.send(topic, key=key, value=value, headers=headers)
        producer.flush(timeout=120)
        return count / (time.perf_counter() - started)
    finally:
        producer.close(timeout=10)


def send_as_the_relay(producer: KafkaProducer, topic: str, recs: list[Record], batch: int) -> None:
    """A batch's keys hashed at once, then its records sent with their partitions."""
    for start in range(0, len(recs), batch):
        chunk = recs[start : start + batch]
        partitions = Partitions(producer)
        hashes = key_hashes([key for key, _, _ in chunk])
        for (key, value, headers), key_hash in zip(chunk, hashes, strict=True):
            producer.send(
                topic,
                key=key,
                value=value,
                headers=headers,
                partition=partitions.of(topic, key_hash),
            )


def main(argv: list[str]) -> int:
    given = "--partitions-given" in argv
    url, bootstrap, topic, count = [arg for arg in argv if arg != "--partitions-given"]
    per_s = rate(url, bootstrap, topic, int(count), given)
    print(json.dumps({"events": int(count), "per_s": per_s}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
