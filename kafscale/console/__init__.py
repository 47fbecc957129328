"""The web console: a read-only view of the cluster from etcd (and S3 and
etcd health), with topic creation for a signed-in operator."""
