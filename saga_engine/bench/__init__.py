"""Benchmarks: commands that print figures, with the ceilings they are compared to in the same run.

    saga-engine bench relay     outbox -> Kafka throughput of K relay processes, beside the raw
                                kafka-python producer and the database's claim-and-mark rate
    saga-engine bench saga      the order saga driven by K worker processes (and Temporal, the peer)
    saga-engine bench latency   commit -> broker acknowledgement at a fixed rate, NOTIFY vs polling,
                                and what ``OutboxWriter.add`` adds to a business transaction
    saga-engine bench memory    the RSS of a worker holding 10,000 in-flight sagas

Every benchmark runs in a scratch database it creates on the server of ``--db`` and drops
afterwards, and against a private tansu broker unless ``--broker`` names one. Ratios are measured
side by side in one run, because absolute figures on a shared two-core machine move from run to
run. See docs/benchmarks.md for the method and the figures.
"""
