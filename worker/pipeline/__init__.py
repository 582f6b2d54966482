"""The streaming pipeline: Kafka in, batches through, results out, offsets committed.

In flow order: ``consume`` (group consumer) -> ``intake`` (decode, validate) ->
``batching`` -> [``worker.inference``] -> ``produce`` (send, ack, redeliver;
records built by ``outgoing``) -> ``offsets`` (watermark) -> ``commit``.
``backpressure`` and ``budget`` are pure decisions the stages consult;
``worker`` wires it all together and owns the lifecycle.
"""
