from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class NodeJob(_message.Message):
    __slots__ = ("kind", "run_id", "run_config_json", "explicit_keys", "node_config_json", "node_id", "ticket", "payload")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_KEYS_FIELD_NUMBER: _ClassVar[int]
    NODE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    kind: str
    run_id: int
    run_config_json: str
    explicit_keys: _containers.RepeatedScalarFieldContainer[str]
    node_config_json: str
    node_id: int
    ticket: bytes
    payload: bytes
    def __init__(self, kind: _Optional[str] = ..., run_id: _Optional[int] = ..., run_config_json: _Optional[str] = ..., explicit_keys: _Optional[_Iterable[str]] = ..., node_config_json: _Optional[str] = ..., node_id: _Optional[int] = ..., ticket: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class NodeResult(_message.Message):
    __slots__ = ("upload_digest", "payload", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UPLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    upload_digest: str
    payload: bytes
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, upload_digest: _Optional[str] = ..., payload: _Optional[bytes] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
