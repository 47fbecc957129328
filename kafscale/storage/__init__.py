"""Segment + index format, object store (S3), partition log, segment cache."""
