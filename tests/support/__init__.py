"""Helpers of the test suite and of bench/: seeding, real service processes,
a private Kafka-compatible broker, fault-injection instances, the ledger."""
