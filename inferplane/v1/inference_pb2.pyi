from inferplane.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompleteRequest(_message.Message):
    __slots__ = ("model", "prompt", "params")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    params: _worker_pb2.SamplingParams
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., params: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "params", "tools", "tool_choice")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_worker_pb2.ChatMessage]
    params: _worker_pb2.SamplingParams
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_worker_pb2.ChatMessage, _Mapping]]] = ..., params: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("id", "text", "finished", "finish_reason", "usage", "token_ids", "logprobs", "top_logprobs", "index", "tool_calls")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    finished: bool
    finish_reason: str
    usage: _worker_pb2.Usage
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TopLogprobs]
    index: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_worker_pb2.Usage, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_worker_pb2.TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class EmbeddingsRequest(_message.Message):
    __slots__ = ("model", "texts", "token_ids", "dimensions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenIds]
    dimensions: int
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[_Union[_worker_pb2.TokenIds, _Mapping]]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbeddingsResponse(_message.Message):
    __slots__ = ("id", "data", "dimensions", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    data: _containers.RepeatedCompositeFieldContainer[Embedding]
    dimensions: int
    usage: _worker_pb2.Usage
    def __init__(self, id: _Optional[str] = ..., data: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., dimensions: _Optional[int] = ..., usage: _Optional[_Union[_worker_pb2.Usage, _Mapping]] = ...) -> None: ...
