"""Kafka wire protocol: framing, schemas as data, and one codec."""
