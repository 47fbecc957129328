"""Broker node: listener, request handlers, partition logs."""
