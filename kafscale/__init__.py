"""KafScale: Kafka-compatible brokers with segments in S3 and metadata in etcd."""
