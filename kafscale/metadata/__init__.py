"""Cluster metadata in etcd."""
