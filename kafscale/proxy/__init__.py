"""The metadata-rewriting proxy."""
