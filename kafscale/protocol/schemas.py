"""Kafka API schemas as data, in the notation of codec.py.

Field facts follow Kafka's message specs; only the versions KafScale
implements are listed (`Api.min_version`..`Api.max_version`), and ApiVersions
advertises exactly these ranges."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kafscale import _native
from kafscale.protocol.codec import MAX_VERSION, Message, parse_schema


@dataclass(frozen=True)
class Api:
    key: int
    name: str
    min_version: int
    max_version: int
    request: Message
    response: Message

    def supports(self, version: int) -> bool:
        return self.min_version <= version <= self.max_version


def _api(key: int, name: str, versions: tuple[int, int], flexible: int, request: str, response: str) -> Api:
    return Api(key, name, versions[0], versions[1],
               Message(parse_schema(request), flexible), Message(parse_schema(response), flexible))


PRODUCE = _api(0, "Produce", (3, 12), 9, """
transactional_id: string 3+ ?
acks: int16
timeout_ms: int32
topic_data: [
  name: string
  partition_data: [
    index: int32
    records: records ?
  ]
]
""", """
responses: [
  name: string
  partition_responses: [
    index: int32
    error_code: int16
    base_offset: int64
    log_append_time_ms: int64 2+ default=-1
    log_start_offset: int64 5+ default=-1
    record_errors: [ 8+
      batch_index: int32
      batch_index_error_message: string ? default=null
    ]
    error_message: string 8+ ? default=null
  ]
]
throttle_time_ms: int32 1+
""")
# thousands a second (librdkafka sends one per partition batch): decoded and answered in native code
PRODUCE.request.native_decode = _native.decode_produce_request
PRODUCE.response.native_encode = _native.encode_produce_response

FETCH = _api(1, "Fetch", (4, 17), 12, """
cluster_id: string 12+ ? tag=0 default=null
replica_id: int32 0-14 default=-1
max_wait_ms: int32
min_bytes: int32
max_bytes: int32 3+ default=0x7fffffff
isolation_level: int8 4+
session_id: int32 7+
session_epoch: int32 7+ default=-1
topics: [
  topic: string 0-12
  topic_id: uuid 13+
  partitions: [
    partition: int32
    current_leader_epoch: int32 9+ default=-1
    fetch_offset: int64
    last_fetched_epoch: int32 12+ default=-1
    log_start_offset: int64 5+ default=-1
    partition_max_bytes: int32
  ]
]
forgotten_topics_data: [ 7+
  topic: string 7-12
  topic_id: uuid 13+
  partitions: [int32]
]
rack_id: string 11+
""", """
throttle_time_ms: int32 1+
error_code: int16 7+
session_id: int32 7+
responses: [
  topic: string 0-12
  topic_id: uuid 13+
  partitions: [
    partition_index: int32
    error_code: int16
    high_watermark: int64
    last_stable_offset: int64 4+ default=-1
    log_start_offset: int64 5+ default=-1
    aborted_transactions: [ 4+ ?
      producer_id: int64
      first_offset: int64
    ]
    preferred_read_replica: int32 11+ default=-1
    records: records ?
  ]
]
""")

LIST_OFFSETS = _api(2, "ListOffsets", (0, 10), 6, """
replica_id: int32
isolation_level: int8 2+
topics: [
  name: string
  partitions: [
    partition_index: int32
    current_leader_epoch: int32 4+ default=-1
    timestamp: int64
    max_num_offsets: int32 0 default=1
  ]
]
timeout_ms: int32 10+ default=0
""", """
throttle_time_ms: int32 2+
topics: [
  name: string
  partitions: [
    partition_index: int32
    error_code: int16
    old_style_offsets: [int64] 0
    timestamp: int64 1+ default=-1
    offset: int64 1+ default=-1
    leader_epoch: int32 4+ default=-1
  ]
]
""")

METADATA = _api(3, "Metadata", (0, 13), 9, """
topics: [ ?1
  topic_id: uuid 10+
  name: string ?10
]
allow_auto_topic_creation: bool 4+ default=true
include_cluster_authorized_operations: bool 8-10
include_topic_authorized_operations: bool 8+
""", """
throttle_time_ms: int32 3+
brokers: [
  node_id: int32
  host: string
  port: int32
  rack: string 1+ ? default=null
]
cluster_id: string 2+ ? default=null
controller_id: int32 1+ default=-1
topics: [
  error_code: int16
  name: string ?12
  topic_id: uuid 10+
  is_internal: bool 1+
  partitions: [
    error_code: int16
    partition_index: int32
    leader_id: int32
    leader_epoch: int32 7+ default=-1
    replica_nodes: [int32]
    isr_nodes: [int32]
    offline_replicas: [int32] 5+
  ]
  topic_authorized_operations: int32 8+ default=-2147483648
]
cluster_authorized_operations: int32 8-10 default=-2147483648
error_code: int16 13+
""")

API_VERSIONS = _api(18, "ApiVersions", (0, 4), 3, """
client_software_name: string 3+
client_software_version: string 3+
""", """
error_code: int16
api_keys: [
  api_key: int16
  min_version: int16
  max_version: int16
]
throttle_time_ms: int32 1+
""")

CREATE_TOPICS = _api(19, "CreateTopics", (0, 7), 5, """
topics: [
  name: string
  num_partitions: int32
  replication_factor: int16
  assignments: [
    partition_index: int32
    broker_ids: [int32]
  ]
  configs: [
    name: string
    value: string ?
  ]
]
timeout_ms: int32 default=60000
validate_only: bool 1+
""", """
throttle_time_ms: int32 2+
topics: [
  name: string
  topic_id: uuid 7+
  error_code: int16
  error_message: string 1+ ? default=null
  topic_config_error_code: int16 5+ tag=0
  num_partitions: int32 5+ default=-1
  replication_factor: int16 5+ default=-1
  configs: [ 5+ ?
    name: string
    value: string ?
    read_only: bool
    config_source: int8 default=-1
    is_sensitive: bool
  ]
]
""")

DELETE_TOPICS = _api(20, "DeleteTopics", (0, 6), 4, """
topics: [ 6+
  name: string ? default=null
  topic_id: uuid
]
topic_names: [string] 0-5
timeout_ms: int32
""", """
throttle_time_ms: int32 1+
responses: [
  name: string ?6
  topic_id: uuid 6+
  error_code: int16
  error_message: string 5+ ? default=null
]
""")

INIT_PRODUCER_ID = _api(22, "InitProducerId", (0, 5), 2, """
transactional_id: string ?
transaction_timeout_ms: int32
producer_id: int64 3+ default=-1
producer_epoch: int16 3+ default=-1
""", """
throttle_time_ms: int32
error_code: int16
producer_id: int64 default=-1
producer_epoch: int16
""")

OFFSET_COMMIT = _api(8, "OffsetCommit", (0, 10), 8, """
group_id: string
generation_id_or_member_epoch: int32 1+ default=-1
member_id: string 1+
group_instance_id: string 7+ ? default=null
retention_time_ms: int64 2-4 default=-1
topics: [
  name: string 0-9
  topic_id: uuid 10+
  partitions: [
    partition_index: int32
    committed_offset: int64
    committed_leader_epoch: int32 6+ default=-1
    commit_timestamp: int64 1 default=-1
    committed_metadata: string ?
  ]
]
""", """
throttle_time_ms: int32 3+
topics: [
  name: string 0-9
  topic_id: uuid 10+
  partitions: [
    partition_index: int32
    error_code: int16
  ]
]
""")

OFFSET_FETCH = _api(9, "OffsetFetch", (0, 10), 6, """
group_id: string 0-7
topics: [ 0-7 ?2
  name: string
  partition_indexes: [int32]
]
groups: [ 8+
  group_id: string
  member_id: string 9+ ? default=null
  member_epoch: int32 9+ default=-1
  topics: [ ?8
    name: string 8-9
    topic_id: uuid 10+
    partition_indexes: [int32]
  ]
]
require_stable: bool 7+
""", """
throttle_time_ms: int32 3+
topics: [ 0-7
  name: string
  partitions: [
    partition_index: int32
    committed_offset: int64
    committed_leader_epoch: int32 5+ default=-1
    metadata: string ?
    error_code: int16
  ]
]
error_code: int16 2-7
groups: [ 8+
  group_id: string
  topics: [
    name: string 8-9
    topic_id: uuid 10+
    partitions: [
      partition_index: int32
      committed_offset: int64
      committed_leader_epoch: int32 default=-1
      metadata: string ?
      error_code: int16
    ]
  ]
  error_code: int16
]
""")

FIND_COORDINATOR = _api(10, "FindCoordinator", (0, 6), 3, """
key: string 0-3
key_type: int8 1+
coordinator_keys: [string] 4+
""", """
throttle_time_ms: int32 1+
error_code: int16 0-3
error_message: string 1-3 ?
node_id: int32 0-3
host: string 0-3
port: int32 0-3
coordinators: [ 4+
  key: string
  node_id: int32
  host: string
  port: int32
  error_code: int16
  error_message: string ?
]
""")

JOIN_GROUP = _api(11, "JoinGroup", (0, 9), 6, """
group_id: string
session_timeout_ms: int32
rebalance_timeout_ms: int32 1+ default=-1
member_id: string
group_instance_id: string 5+ ? default=null
protocol_type: string
protocols: [
  name: string
  metadata: bytes
]
reason: string 8+ ? default=null
""", """
throttle_time_ms: int32 2+
error_code: int16
generation_id: int32 default=-1
protocol_type: string 7+ ? default=null
protocol_name: string ?7
leader: string
skip_assignment: bool 9+
member_id: string
members: [
  member_id: string
  group_instance_id: string 5+ ? default=null
  metadata: bytes
]
""")

HEARTBEAT = _api(12, "Heartbeat", (0, 4), 4, """
group_id: string
generation_id: int32
member_id: string
group_instance_id: string 3+ ? default=null
""", """
throttle_time_ms: int32 1+
error_code: int16
""")

LEAVE_GROUP = _api(13, "LeaveGroup", (0, 5), 4, """
group_id: string
member_id: string 0-2
members: [ 3+
  member_id: string
  group_instance_id: string ? default=null
  reason: string 5+ ? default=null
]
""", """
throttle_time_ms: int32 1+
error_code: int16
members: [ 3+
  member_id: string
  group_instance_id: string ?
  error_code: int16
]
""")

SYNC_GROUP = _api(14, "SyncGroup", (0, 5), 4, """
group_id: string
generation_id: int32
member_id: string
group_instance_id: string 3+ ? default=null
protocol_type: string 5+ ? default=null
protocol_name: string 5+ ? default=null
assignments: [
  member_id: string
  assignment: bytes
]
""", """
throttle_time_ms: int32 1+
error_code: int16
protocol_type: string 5+ ? default=null
protocol_name: string 5+ ? default=null
assignment: bytes
""")

DESCRIBE_GROUPS = _api(15, "DescribeGroups", (0, 6), 5, """
groups: [string]
include_authorized_operations: bool 3+
""", """
throttle_time_ms: int32 1+
groups: [
  error_code: int16
  error_message: string 6+ ? default=null
  group_id: string
  group_state: string
  protocol_type: string
  protocol_data: string
  members: [
    member_id: string
    group_instance_id: string 4+ ? default=null
    client_id: string
    client_host: string
    member_metadata: bytes
    member_assignment: bytes
  ]
  authorized_operations: int32 3+ default=-2147483648
]
""")

LIST_GROUPS = _api(16, "ListGroups", (0, 5), 3, """
states_filter: [string] 4+
types_filter: [string] 5+
""", """
throttle_time_ms: int32 1+
error_code: int16
groups: [
  group_id: string
  protocol_type: string
  group_state: string 4+
  group_type: string 5+
]
""")

DELETE_GROUPS = _api(42, "DeleteGroups", (0, 2), 2, """
groups_names: [string]
""", """
throttle_time_ms: int32
results: [
  group_id: string
  error_code: int16
]
""")

OFFSET_FOR_LEADER_EPOCH = _api(23, "OffsetForLeaderEpoch", (0, 4), 4, """
replica_id: int32 3+ default=-2
topics: [
  topic: string
  partitions: [
    partition: int32
    current_leader_epoch: int32 2+ default=-1
    leader_epoch: int32
  ]
]
""", """
throttle_time_ms: int32 2+
topics: [
  topic: string
  partitions: [
    error_code: int16
    partition: int32
    leader_epoch: int32 1+ default=-1
    end_offset: int64 default=-1
  ]
]
""")

DESCRIBE_CONFIGS = _api(32, "DescribeConfigs", (0, 4), 4, """
resources: [
  resource_type: int8
  resource_name: string
  configuration_keys: [string] ?
]
include_synonyms: bool 1+
include_documentation: bool 3+
""", """
throttle_time_ms: int32
results: [
  error_code: int16
  error_message: string ?
  resource_type: int8
  resource_name: string
  configs: [
    name: string
    value: string ?
    read_only: bool
    is_default: bool 0
    config_source: int8 1+ default=-1
    is_sensitive: bool
    synonyms: [ 1+
      name: string
      value: string ?
      source: int8
    ]
    config_type: int8 3+
    documentation: string 3+ ?
  ]
]
""")

_ALTER_CONFIGS_RESPONSE = """
throttle_time_ms: int32
responses: [
  error_code: int16
  error_message: string ?
  resource_type: int8
  resource_name: string
]
"""

ALTER_CONFIGS = _api(33, "AlterConfigs", (0, 2), 2, """
resources: [
  resource_type: int8
  resource_name: string
  configs: [
    name: string
    value: string ?
  ]
]
validate_only: bool
""", _ALTER_CONFIGS_RESPONSE)

CREATE_PARTITIONS = _api(37, "CreatePartitions", (0, 3), 2, """
topics: [
  name: string
  count: int32
  assignments: [ ?
    broker_ids: [int32]
  ]
]
timeout_ms: int32
validate_only: bool
""", """
throttle_time_ms: int32
results: [
  name: string
  error_code: int16
  error_message: string ? default=null
]
""")

INCREMENTAL_ALTER_CONFIGS = _api(44, "IncrementalAlterConfigs", (0, 1), 1, """
resources: [
  resource_type: int8
  resource_name: string
  configs: [
    name: string
    config_operation: int8
    value: string ?
  ]
]
validate_only: bool
""", _ALTER_CONFIGS_RESPONSE)

DESCRIBE_CLUSTER = _api(60, "DescribeCluster", (0, 2), 0, """
include_cluster_authorized_operations: bool
endpoint_type: int8 1+ default=1
include_fenced_brokers: bool 2+
""", """
throttle_time_ms: int32
error_code: int16
error_message: string ? default=null
endpoint_type: int8 1+ default=1
cluster_id: string
controller_id: int32 default=-1
brokers: [
  broker_id: int32
  host: string
  port: int32
  rack: string ? default=null
  is_fenced: bool 2+
]
cluster_authorized_operations: int32 default=-2147483648
""")

# After a v0 handshake the client sends bare SASL tokens (no Kafka header), answered bare.
SASL_HANDSHAKE = _api(17, "SaslHandshake", (0, 1), MAX_VERSION, """
mechanism: string
""", """
error_code: int16
mechanisms: [string]
""")

SASL_AUTHENTICATE = _api(36, "SaslAuthenticate", (0, 2), 2, """
auth_bytes: bytes
""", """
error_code: int16
error_message: string ?
auth_bytes: bytes
session_lifetime_ms: int64 1+
""")

_ACL_FILTER = """
resource_type_filter: int8
resource_name_filter: string ?
pattern_type_filter: int8 1+ default=3
principal_filter: string ?
host_filter: string ?
operation: int8
permission_type: int8
"""

DESCRIBE_ACLS = _api(29, "DescribeAcls", (0, 3), 2, _ACL_FILTER, """
throttle_time_ms: int32
error_code: int16
error_message: string ?
resources: [
  resource_type: int8
  resource_name: string
  pattern_type: int8 1+ default=3
  acls: [
    principal: string
    host: string
    operation: int8
    permission_type: int8
  ]
]
""")

CREATE_ACLS = _api(30, "CreateAcls", (0, 3), 2, """
creations: [
  resource_type: int8
  resource_name: string
  resource_pattern_type: int8 1+ default=3
  principal: string
  host: string
  operation: int8
  permission_type: int8
]
""", """
throttle_time_ms: int32
results: [
  error_code: int16
  error_message: string ?
]
""")

DELETE_ACLS = _api(31, "DeleteAcls", (0, 3), 2, """
filters: [
""" + _ACL_FILTER + """]
""", """
throttle_time_ms: int32
filter_results: [
  error_code: int16
  error_message: string ?
  matching_acls: [
    error_code: int16
    error_message: string ?
    resource_type: int8
    resource_name: string
    pattern_type: int8 1+ default=3
    principal: string
    host: string
    operation: int8
    permission_type: int8
  ]
]
""")

DELETE_RECORDS = _api(21, "DeleteRecords", (0, 2), 2, """
topics: [
  name: string
  partitions: [
    partition_index: int32
    offset: int64
  ]
]
timeout_ms: int32
""", """
throttle_time_ms: int32
topics: [
  name: string
  partitions: [
    partition_index: int32
    low_watermark: int64
    error_code: int16
  ]
]
""")

OFFSET_DELETE = _api(47, "OffsetDelete", (0, 0), MAX_VERSION, """
group_id: string
topics: [
  name: string
  partitions: [
    partition_index: int32
  ]
]
""", """
error_code: int16
throttle_time_ms: int32
topics: [
  name: string
  partitions: [
    partition_index: int32
    error_code: int16
  ]
]
""")

DESCRIBE_USER_SCRAM_CREDENTIALS = _api(50, "DescribeUserScramCredentials", (0, 0), 0, """
users: [ ?
  name: string
]
""", """
throttle_time_ms: int32
error_code: int16
error_message: string ?
results: [
  user: string
  error_code: int16
  error_message: string ?
  credential_infos: [
    mechanism: int8
    iterations: int32
  ]
]
""")

ALTER_USER_SCRAM_CREDENTIALS = _api(51, "AlterUserScramCredentials", (0, 0), 0, """
deletions: [
  name: string
  mechanism: int8
]
upsertions: [
  name: string
  mechanism: int8
  iterations: int32
  salt: bytes
  salted_password: bytes
]
""", """
throttle_time_ms: int32
results: [
  user: string
  error_code: int16
  error_message: string ?
]
""")

DESCRIBE_LOG_DIRS = _api(35, "DescribeLogDirs", (0, 5), 2, """
topics: [ ?
  topic: string
  partitions: [int32]
]
""", """
throttle_time_ms: int32
error_code: int16 3+
results: [
  error_code: int16
  log_dir: string
  topics: [
    name: string
    partitions: [
      partition_index: int32
      partition_size: int64
      offset_lag: int64
      is_future_key: bool
    ]
  ]
  total_bytes: int64 4+ default=-1
  usable_bytes: int64 4+ default=-1
  is_cordoned: bool 5+
]
""")

ELECT_LEADERS = _api(43, "ElectLeaders", (0, 2), 2, """
election_type: int8 1+
topic_partitions: [ ?
  topic: string
  partitions: [int32]
]
timeout_ms: int32
""", """
throttle_time_ms: int32
error_code: int16 1+
replica_election_results: [
  topic: string
  partition_result: [
    partition_id: int32
    error_code: int16
    error_message: string ?
  ]
]
""")

ALTER_PARTITION_REASSIGNMENTS = _api(45, "AlterPartitionReassignments", (0, 0), 0, """
timeout_ms: int32
topics: [
  name: string
  partitions: [
    partition_index: int32
    replicas: [int32] ?
  ]
]
""", """
throttle_time_ms: int32
error_code: int16
error_message: string ?
responses: [
  name: string
  partitions: [
    partition_index: int32
    error_code: int16
    error_message: string ?
  ]
]
""")

LIST_PARTITION_REASSIGNMENTS = _api(46, "ListPartitionReassignments", (0, 0), 0, """
timeout_ms: int32
topics: [ ?
  name: string
  partition_indexes: [int32]
]
""", """
throttle_time_ms: int32
error_code: int16
error_message: string ?
topics: [
  name: string
  partitions: [
    partition_index: int32
    replicas: [int32]
    adding_replicas: [int32]
    removing_replicas: [int32]
  ]
]
""")

DESCRIBE_TOPIC_PARTITIONS = _api(75, "DescribeTopicPartitions", (0, 0), 0, """
topics: [
  name: string
]
response_partition_limit: int32
cursor: { ?
  topic_name: string
  partition_index: int32
}
""", """
throttle_time_ms: int32
topics: [
  error_code: int16
  name: string ?
  topic_id: uuid
  is_internal: bool
  partitions: [
    error_code: int16
    partition_index: int32
    leader_id: int32
    leader_epoch: int32 default=-1
    replica_nodes: [int32]
    isr_nodes: [int32]
    eligible_leader_replicas: [int32] ?
    last_known_elr: [int32] ?
    offline_replicas: [int32]
  ]
  topic_authorized_operations: int32 default=-2147483648
]
next_cursor: { ?
  topic_name: string
  partition_index: int32
}
""")

APIS: dict[int, Api] = {a.key: a for a in (
    PRODUCE, FETCH, LIST_OFFSETS, METADATA, OFFSET_COMMIT, OFFSET_FETCH, FIND_COORDINATOR, JOIN_GROUP, HEARTBEAT,
    LEAVE_GROUP, SYNC_GROUP, DESCRIBE_GROUPS, LIST_GROUPS, API_VERSIONS, CREATE_TOPICS, DELETE_TOPICS,
    INIT_PRODUCER_ID, OFFSET_FOR_LEADER_EPOCH, DESCRIBE_CONFIGS, ALTER_CONFIGS, CREATE_PARTITIONS, DELETE_GROUPS,
    INCREMENTAL_ALTER_CONFIGS, DESCRIBE_CLUSTER, SASL_HANDSHAKE, SASL_AUTHENTICATE, DESCRIBE_ACLS, CREATE_ACLS,
    DELETE_ACLS, DELETE_RECORDS, OFFSET_DELETE, DESCRIBE_USER_SCRAM_CREDENTIALS, ALTER_USER_SCRAM_CREDENTIALS,
    DESCRIBE_LOG_DIRS, ELECT_LEADERS, ALTER_PARTITION_REASSIGNMENTS, LIST_PARTITION_REASSIGNMENTS,
    DESCRIBE_TOPIC_PARTITIONS,
)}


def api_versions_response() -> dict[str, Any]:
    """The ApiVersions answer: exactly the ranges in APIS."""
    keys = [{"api_key": a.key, "min_version": a.min_version, "max_version": a.max_version}
            for a in sorted(APIS.values(), key=lambda a: a.key)]
    return {"error_code": 0, "api_keys": keys, "throttle_time_ms": 0}
