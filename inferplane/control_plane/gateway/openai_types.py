"""OpenAI-compatible request bodies, validated by pydantic, and their mapping to sampling params.

Each body checks the range of its own fields (max_tokens in [1, 2**32), as the wire type holds);
what depends on the prompt (max_tokens against the context left) is `InferenceService.prepare`'s
to check, and it builds the worker's `SamplingParams` once, with `SamplingRequest.sampling_params`.

Unknown fields are ignored (clients send assorted extras). OpenAI parameters this server does not
serve (the deprecated functions, audio, suffix, best_of, ...) are refused
with a 400 naming them when they ask for something, never silently dropped; their neutral values
(`tool_choice: "none"`, `response_format: {"type": "text"}`, ...) are accepted. Types are strict, as
OpenAI's: `"5"` is not a number.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from inferplane.api.grammar_limits import MAX_CONSTRAINT_CHOICES, MAX_REGEX_CHARS
from inferplane.api.tokenizer import reserved_template_variable
from inferplane.control_plane.gateway.structured_outputs import (
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoice,
    constraint,
    extension_constraint,
    forced_tools,
)
from inferplane.v1 import worker_pb2

# The wire types of worker.proto's SamplingParams: a larger number is a 422, not an overflow (500).
INT32_MAX, UINT32_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**64 - 1


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON's "\\ud800"), or None.

    Such a string is not Unicode text: tokenizers and the gRPC wire (UTF-8) cannot carry it.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _neutral(value: Any, *neutral: Any) -> bool:
    return value is None or value in neutral or (isinstance(value, dict | list) and not value)


# OpenAI parameters not served yet, with the values that ask for nothing (accepted); see issue 17.
UNSERVED: dict[str, tuple[Any, ...]] = {
    "functions": (), "function_call": ("none",), "prediction": (),
    "audio": (), "modalities": (["text"],), "suffix": ("",), "best_of": (1,),
}


MAX_CHOICES = 128  # OpenAI's bound on n; also on prompts x n in one /v1/completions request


class StreamOptions(_Base):
    include_usage: bool = False


class SamplingRequest(_Base):
    """The fields every generation body has (completions and chat): what the worker samples by."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=INT32_MAX)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="choices; the prompt is computed once and forked")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="vLLM's extension; 1 is off")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (as a string) -> [-100, 100]")
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX, description="vLLM's extension")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM's extension: tokens below min_p x the top "
                                                                  "token's probability are out; 0 disables")
    ignore_eos: bool = Field(default=False, description="vLLM's extension: decode past end-of-sequence tokens "
                                                        "until max_tokens (load tests)")
    user: str | None = None
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's extension: {json | regex | choice}")
    guided_regex: str | None = Field(default=None, min_length=1, max_length=MAX_REGEX_CHARS,
                                     description="vLLM's earlier extension")
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CONSTRAINT_CHOICES,
                                            description="vLLM's earlier extension")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's earlier extension")

    @model_validator(mode="before")
    @classmethod
    def _unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in UNSERVED.items():
                if name in data and not _neutral(data[name], *neutral):
                    raise PydanticCustomError("unserved", "{name}: not supported by this server yet",
                                              {"name": name, "param": name})
        return data

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where:
            raise ValueError(f"{where}: not valid Unicode text (a lone UTF-16 surrogate)")
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > UINT32_MAX:
                raise ValueError(f"keys are token ids as strings, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: bias must be in [-100, 100], got {bias}")
        return value

    def asked_max_tokens(self) -> int | None:
        """The cap the client asked for (None: none; `prepare` then works one out)."""
        return self.max_tokens

    def logprobs_wanted(self) -> bool:
        """Whether each output token comes with its logprob (the two bodies say so differently)."""
        raise NotImplementedError

    def top_logprobs_wanted(self) -> int:
        return 0

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token to score (None: the prompt is not scored)."""
        return None

    def constraint(self) -> tuple[str, str]:
        """The structured-output constraint (kind, spec) the worker applies: vLLM's extensions here."""
        return self.extension_constraint()

    def extension_constraint(self) -> tuple[str, str]:
        return extension_constraint(self.structured_outputs, self.guided_regex, self.guided_choice, self.guided_json)

    @model_validator(mode="after")
    def _one_extension(self) -> SamplingRequest:
        try:
            self.extension_constraint()
        except ValueError as exc:
            name, message = str(exc).split(": ", 1)
            raise PydanticCustomError("invalid_value", "{message}", {"message": message, "param": name}) from None
        return self

    def sampling_params(self, max_tokens: int, *, stop_token_ids: Sequence[int] = (),
                        ignore_eos: bool = False) -> worker_pb2.SamplingParams:
        """The worker's sampling parameters, every field set here and only here. `max_tokens` is
        the one `prepare` settled (asked for and checked against the context, or worked out);
        `stop_token_ids` is the gRPC API's own field; `ignore_eos` the gRPC API's, or a REST body's
        (vLLM's extension)."""
        kind, spec = self.constraint()
        want_logprobs = self.logprobs_wanted()
        return worker_pb2.SamplingParams(
            constraint_kind=kind, constraint_spec=spec,
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed, stop=list(self.stop or []), stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos or self.ignore_eos,
            logprobs=want_logprobs, top_logprobs=self.top_logprobs_wanted() if want_logprobs else 0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, n=self.n,
            prompt_logprobs=self.prompt_logprobs_wanted(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, token ids, or a list of either (each prompt gets n choices)")
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def logprobs_wanted(self) -> bool:
        return self.logprobs is not None

    def top_logprobs_wanted(self) -> int:
        return self.logprobs or 0

    def prompt_logprobs_wanted(self) -> int | None:
        """The echoed prompt's tokens come with logprobs too."""
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            value = [value]  # one prompt as token ids
        prompts = value if isinstance(value, list) else [value]
        if not prompts:
            raise ValueError("prompt must not be empty")
        for i, prompt in enumerate(prompts):
            where = f"prompt {i}" if len(prompts) > 1 else "prompt"
            if not prompt:
                raise ValueError(f"{where} must not be empty")
            if isinstance(prompt, list) and any(not 0 <= t <= UINT32_MAX for t in prompt):
                raise ValueError(f"{where}: token ids must be in [0, 2**32)")
        return value

    @model_validator(mode="after")
    def _choices_bounded(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise PydanticCustomError("invalid_value", "{prompts} prompts x n={n} is more than {most} choices",
                                      {"prompts": len(self.prompts), "n": self.n, "most": MAX_CHOICES, "param": "n"})
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt, as text or token ids, in order."""
        value = self.prompt
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return [value]
        return list(value) if isinstance(value, list) else [value]


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        """What the chat template shows: text parts; an assistant's calls as the JSON it wrote."""
        if self.tool_calls and not self.content:
            return json.dumps([{"name": c.get("function", {}).get("name"),
                                "arguments": c.get("function", {}).get("arguments")} for c in self.tool_calls])
        if isinstance(self.content, list):  # content parts: only text parts are understood
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # one call per answer either way
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description=(
        "vLLM's extension: extra variables for the chat template, as transformers' apply_chat_template "
        "takes them (Qwen3's enable_thinking)"))

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
            raise PydanticCustomError("invalid_value", "must be an object of template variables, got {kind}",
                                      {"kind": kind.get(type(value), type(value).__name__)})
        return value

    @model_validator(mode="after")
    def _template_kwargs_not_reserved(self) -> ChatCompletionRequest:
        """The template's own variables (messages, bos_token, tools, ...) are the server's to set: a
        400 naming the variable rather than a prompt rewritten around the messages."""
        for name in self.chat_template_kwargs or {}:
            if reserved_template_variable(name):
                raise PydanticCustomError(
                    "invalid_value", "set by the server's chat template renderer; it cannot be overridden",
                    {"param": f"chat_template_kwargs.{name}"})
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_value", "needs logprobs: true", {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _one_constraint(self) -> ChatCompletionRequest:
        try:
            forced = forced_tools(self.tools, self.tool_choice)
        except ValueError as exc:
            message = str(exc).removeprefix("tool_choice: ")
            raise PydanticCustomError("invalid_value", "{message}",
                                      {"message": message, "param": "tool_choice"}) from None
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError("invalid_value", "a forced tool call cannot also follow response_format",
                                      {"param": "tool_choice"})
        formatted = forced or (self.response_format is not None and self.response_format.type != "text")
        if formatted and self.extension_constraint() != ("", ""):
            raise PydanticCustomError("invalid_value", "give one output constraint: response_format or tool_choice, "
                                      "or vLLM's structured_outputs/guided_*", {"param": "response_format"})
        return self

    @property
    def offers_tools(self) -> bool:
        """Tools the model may call (tool_choice auto, the default with tools), or must (forced)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def auto_tools(self) -> bool:
        """The model decides whether to call: a template's tool-call format is parsed (tool_formats.py)."""
        return self.offers_tools and self.tool_choice in (None, "auto")

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools or []]

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a call must go to (tool_choice required or named), else None."""
        return forced_tools(self.tools, self.tool_choice)

    def constraint(self) -> tuple[str, str]:
        return constraint(self.response_format, self.forced_tools) if self.forced_tools or (
            self.response_format is not None and self.response_format.type != "text") else self.extension_constraint()

    def logprobs_wanted(self) -> bool:
        return self.logprobs

    def top_logprobs_wanted(self) -> int:
        return self.top_logprobs or 0

    def asked_max_tokens(self) -> int | None:
        """OpenAI's newer name first; max_tokens is its deprecated alias."""
        return self.max_completion_tokens or self.max_tokens


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _input_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{message}", {"message": message})


def _token_ids(value: list, where: str) -> list[int]:
    """A list of token ids (not bools, within the wire's uint32), or a 400 naming `where` ("" for
    the one input, "item 3: " for one of several)."""
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool):
            raise _input_error(f"{where}token ids must be integers, got {type(token).__name__} {token!r}")
        if not 0 <= token <= UINT32_MAX:
            raise _input_error(f"{where}token ids must be in [0, 2**32), got {token}")
    return value


class EmbeddingRequest(_Base):
    """OpenAI's embeddings body. `input` is checked by hand, before pydantic's union, so that a
    wrong shape gets one sentence naming what is wrong (an empty string, item 3, a mix), not
    four union branches' errors."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"{_INPUT_SHAPES}; at most {MAX_EMBEDDING_INPUTS} inputs, none empty")
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: each vector's float32 values, little-endian, base64-encoded")
    dimensions: int | None = Field(default=None, ge=1, le=UINT32_MAX, description=(
        "only the model's own size, unless the model is trained to be shortened (Matryoshka)"))
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where:
            raise PydanticCustomError("invalid_value", "{where}: not valid Unicode text (a lone UTF-16 surrogate)",
                                      {"where": where, "param": where.split(".", 1)[0]})
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise _input_error("must not be an empty string")
            return value
        if not isinstance(value, list):
            raise _input_error(f"must be {_INPUT_SHAPES}")
        if not value:
            raise _input_error("must not be an empty list")
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise _input_error(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}")
        if all(isinstance(v, int) for v in value):
            return _token_ids(value, "")  # one input as token ids
        kinds = {type(v) for v in value}
        if kinds not in ({str}, {list}):
            raise _input_error(f"must be {_INPUT_SHAPES}" + (", not a mix" if len(kinds) > 1 else ""))
        for i, item in enumerate(value):
            if not item:
                raise _input_error(f"item {i} is empty")
            if isinstance(item, list):
                _token_ids(item, f"item {i}: ")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """Every input, in order: all text or all token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]
