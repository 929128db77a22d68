from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ticket(_message.Message):
    __slots__ = ("address", "round", "size", "digest", "download_token", "upload_token", "max_upload", "tls", "checksum", "session")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    address: str
    round: int
    size: int
    digest: str
    download_token: str
    upload_token: str
    max_upload: int
    tls: bool
    checksum: str
    session: bool
    def __init__(self, address: _Optional[str] = ..., round: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., download_token: _Optional[str] = ..., upload_token: _Optional[str] = ..., max_upload: _Optional[int] = ..., tls: _Optional[bool] = ..., checksum: _Optional[str] = ..., session: _Optional[bool] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("token", "node_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    node_id: int
    def __init__(self, token: _Optional[str] = ..., node_id: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "size", "digest", "checksum", "finished")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    size: int
    digest: str
    checksum: str
    finished: bool
    def __init__(self, data: _Optional[bytes] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., checksum: _Optional[str] = ..., finished: _Optional[bool] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("token", "node_id", "size", "digest", "data", "checksum")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    token: str
    node_id: int
    size: int
    digest: str
    data: bytes
    checksum: str
    def __init__(self, token: _Optional[str] = ..., node_id: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., data: _Optional[bytes] = ..., checksum: _Optional[str] = ...) -> None: ...

class UploadReceipt(_message.Message):
    __slots__ = ("size", "digest", "next")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    size: int
    digest: str
    next: Ticket
    def __init__(self, size: _Optional[int] = ..., digest: _Optional[str] = ..., next: _Optional[_Union[Ticket, _Mapping]] = ...) -> None: ...
