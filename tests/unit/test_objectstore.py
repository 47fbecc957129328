"""The S3 clients' endpoint cache works for every key of a bucket."""
from __future__ import annotations

import json

import botocore.session

from kafscale.storage.objectstore import UNUSED_ENDPOINT_PARAMS, sync_client


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        own = {node["ref"]} if isinstance(node.get("ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_no_s3_endpoint_rule_reads_the_parameters_left_out():
    """Leaving them out changes no endpoint while botocore's S3 rules never read them
    (this fails, and the list must shrink, the day a rule starts to)."""
    loader = botocore.session.get_session().get_component("data_loader")
    rules = loader.load_service_model("s3", "endpoint-rule-set-1")
    assert set(UNUSED_ENDPOINT_PARAMS) <= set(rules["parameters"])  # still declared: still worth leaving out
    assert not _refs(rules["rules"]) & set(UNUSED_ENDPOINT_PARAMS), json.dumps(sorted(_refs(rules["rules"])))


def test_endpoints_resolve_once_per_bucket_not_per_key():
    client = sync_client("http://127.0.0.1:9", "us-east-1", "k", "s")
    cache_info = type(client._ruleset_resolver._provider).resolve_endpoint.cache_info  # one cache per process
    before = cache_info()
    for i in range(20):
        client.generate_presigned_url("get_object", Params={"Bucket": "b", "Key": f"k{i}"})
    after = cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 19)
