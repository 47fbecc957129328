"""An error response for any request, built from the schemas: what a handler
answers when it cannot do its work (etcd unreachable, a bug), so that the
client gets a Kafka error code instead of a closed connection.

Kafka's responses mirror their requests: one result per requested topic,
partition, group or resource, keyed by the same name or index. So the response
schema is walked; each array of structs mirrors the request's array at the
same depth (by name, else the only or first array there), its key fields are
copied from the request item, and every error code is set. Kafka writes such a
builder by hand for each request class (`getErrorResponse`); one walk over the
schema serves every API here."""
from __future__ import annotations

from typing import Any

from kafscale.protocol import schemas
from kafscale.protocol.codec import Field
from kafscale.protocol.errors import ErrorCode
from kafscale.protocol.schemas import Api

# response field -> request fields that carry the same key
_ALIASES = {
    "name": ("name", "topic"),
    "topic": ("topic", "name"),
    "partition_index": ("partition_index", "partition", "index"),
    "index": ("index", "partition_index", "partition"),
    "partition": ("partition", "partition_index", "index"),
    "group_id": ("group_id", "groups", "key"),
    "key": ("key", "group_id"),
}


# offsets, watermarks, timestamps and epochs are unknown in an error: -1, as Kafka answers
_UNKNOWN = frozenset({"base_offset", "high_watermark", "low_watermark", "last_stable_offset", "log_start_offset",
                      "offset", "timestamp", "end_offset", "log_append_time_ms", "committed_offset", "leader_epoch",
                      "committed_leader_epoch"})

_GROUP_APIS = {a.key for a in (schemas.FIND_COORDINATOR, schemas.JOIN_GROUP, schemas.SYNC_GROUP, schemas.HEARTBEAT,
                                schemas.LEAVE_GROUP, schemas.OFFSET_COMMIT, schemas.OFFSET_FETCH,
                                schemas.DESCRIBE_GROUPS, schemas.LIST_GROUPS, schemas.DELETE_GROUPS)}


def unavailable_code(api_key: int) -> ErrorCode:
    """The retriable error for a request this broker cannot serve right now
    (etcd or S3 unreachable): each client retries it (after a metadata refresh,
    or after finding the coordinator again)."""
    if api_key in _GROUP_APIS:
        return ErrorCode.COORDINATOR_NOT_AVAILABLE
    if api_key == schemas.METADATA.key:
        return ErrorCode.LEADER_NOT_AVAILABLE
    return ErrorCode.REQUEST_TIMED_OUT


def error_response(api: Api, version: int, req: dict[str, Any], code: int, message: str) -> dict[str, Any]:
    return _struct(api.response.fields, version, req, code, message)


def _struct(fields: list[Field], version: int, req: Any, code: int, message: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    arrays = [k for k, v in req.items() if isinstance(v, list)] if isinstance(req, dict) else []
    for f in fields:
        if not f.present(version):
            continue
        if f.name == "error_code":
            out[f.name] = code
        elif f.name in _UNKNOWN and f.type in ("int32", "int64"):
            out[f.name] = -1
        elif f.name == "error_message" and f.type == "string":
            out[f.name] = message
        elif f.type == "array" and f.fields:
            source = f.name if f.name in arrays else (arrays[0] if arrays else None)
            items = (req.get(source) or []) if source is not None else []
            out[f.name] = [_struct(f.fields, version, item, code, message) for item in items]
        elif isinstance(req, dict):
            for alias in _ALIASES.get(f.name, (f.name,)):
                if alias in req and not isinstance(req[alias], list | dict):
                    out[f.name] = req[alias]
                    break
        elif isinstance(req, str) and f.type == "string" and f.name in _ALIASES:  # an array of names
            out[f.name] = req
    return out
