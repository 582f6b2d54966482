"""infer-worker: a Kafka-native micro-batching inference worker."""

__version__ = "0.1.0"
