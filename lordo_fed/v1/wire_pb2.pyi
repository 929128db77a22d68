from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    RAW: _ClassVar[Codec]
    BF16_BITS: _ClassVar[Codec]
    QUANT: _ClassVar[Codec]
    TOPK: _ClassVar[Codec]
    TOPK_QUANT: _ClassVar[Codec]
    ROWS: _ClassVar[Codec]

class Levels(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRID: _ClassVar[Levels]
    LUT: _ClassVar[Levels]
    SIGN: _ClassVar[Levels]

class IndexCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIXED: _ClassVar[IndexCoding]
    RICE: _ClassVar[IndexCoding]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
INT64: DType
INT32: DType
CODEC_UNSPECIFIED: Codec
RAW: Codec
BF16_BITS: Codec
QUANT: Codec
TOPK: Codec
TOPK_QUANT: Codec
ROWS: Codec
GRID: Levels
LUT: Levels
SIGN: Levels
FIXED: IndexCoding
RICE: IndexCoding

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "codec", "nbytes", "data", "bits", "block", "chunk", "topk", "sqrt", "levels", "index_coding", "tile")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    SQRT_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    INDEX_CODING_FIELD_NUMBER: _ClassVar[int]
    TILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: Codec
    nbytes: int
    data: bytes
    bits: int
    block: int
    chunk: int
    topk: int
    sqrt: bool
    levels: Levels
    index_coding: IndexCoding
    tile: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., nbytes: _Optional[int] = ..., data: _Optional[bytes] = ..., bits: _Optional[int] = ..., block: _Optional[int] = ..., chunk: _Optional[int] = ..., topk: _Optional[int] = ..., sqrt: _Optional[bool] = ..., levels: _Optional[_Union[Levels, str]] = ..., index_coding: _Optional[_Union[IndexCoding, str]] = ..., tile: _Optional[int] = ...) -> None: ...

class GlobalState(_message.Message):
    __slots__ = ("schema", "model_id", "round", "opt_step", "params", "projections", "moments", "params_from_seed", "params_delta", "local_steps", "relay", "outer_lr", "relay_own", "relay_own_digest")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OPT_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FROM_SEED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    RELAY_OWN_FIELD_NUMBER: _ClassVar[int]
    RELAY_OWN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    schema: str
    model_id: str
    round: int
    opt_step: int
    params: _containers.RepeatedCompositeFieldContainer[Tensor]
    projections: _containers.RepeatedCompositeFieldContainer[Tensor]
    moments: _containers.RepeatedCompositeFieldContainer[Tensor]
    params_from_seed: bool
    params_delta: bool
    local_steps: int
    relay: _containers.RepeatedScalarFieldContainer[bytes]
    outer_lr: float
    relay_own: int
    relay_own_digest: str
    def __init__(self, schema: _Optional[str] = ..., model_id: _Optional[str] = ..., round: _Optional[int] = ..., opt_step: _Optional[int] = ..., params: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., projections: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., moments: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., params_from_seed: _Optional[bool] = ..., params_delta: _Optional[bool] = ..., local_steps: _Optional[int] = ..., relay: _Optional[_Iterable[bytes]] = ..., outer_lr: _Optional[float] = ..., relay_own: _Optional[int] = ..., relay_own_digest: _Optional[str] = ...) -> None: ...

class WorkerUpdate(_message.Message):
    __slots__ = ("schema", "model_id", "round", "worker_id", "tokens", "opt_step", "delta", "moments", "metrics", "delta_coords")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPT_STEP_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DELTA_COORDS_FIELD_NUMBER: _ClassVar[int]
    schema: str
    model_id: str
    round: int
    worker_id: int
    tokens: int
    opt_step: int
    delta: _containers.RepeatedCompositeFieldContainer[Tensor]
    moments: _containers.RepeatedCompositeFieldContainer[Tensor]
    metrics: _containers.ScalarMap[str, float]
    delta_coords: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, schema: _Optional[str] = ..., model_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[int] = ..., tokens: _Optional[int] = ..., opt_step: _Optional[int] = ..., delta: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., moments: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., delta_coords: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...
