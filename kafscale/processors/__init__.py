"""Processors: jobs that read segments straight from S3, never from a broker."""
