"""Issue 53, items 7 and 8: what reading a registered file's metadata may cost and what it may say.

A 40 MiB GGUF with one large metadata array grew the gateway by 360 MB: every array element became
a Python object as the header was read, for a registry that needs two scalar keys. Now arrays (and
long strings) stay in the file until asked for, the header is bounded (keys, key and string
lengths, array lengths and nesting, tensors), and a context length outside 1..2**24 is a 400
naming the file and the key, never a row (a 64-bit value reached SQLite as a 500).
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from inferplane.api import gguf_reader
from inferplane.api.gguf_reader import open_gguf
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.orm import Model
from inferplane.control_plane.registry import (
    MAX_CONTEXT_LENGTH,
    InvalidMetadata,
    clear_inspect_cache,
    inspect_model,
    register_model,
)

U8, I32, U32, F32, BOOL, STRING, ARRAY, U64, I64 = 0, 5, 4, 6, 7, 8, 9, 10, 11
_PACK = {U8: "<B", I32: "<i", U32: "<I", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q"}


def s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def scalar(kind: int, value: object) -> bytes:
    return struct.pack("<I", kind) + (s(value) if kind == STRING else struct.pack(_PACK[kind], value))  # type: ignore[arg-type]


def array(item: int, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IIQ", ARRAY, item, count) + payload


def strings(count: int, text: bytes = b"ab") -> bytes:
    """`count` copies of `text` as a GGUF string array's payload, built in one numpy pass."""
    rows = np.zeros(count, dtype=np.dtype([("n", "<u8"), ("s", f"S{len(text)}")]))
    rows["n"], rows["s"] = len(text), text
    return rows.tobytes()


def gguf(path: Path, kvs: list[tuple[str | bytes, bytes]], *, kv_count: int | None = None,
         tensor_count: int = 0) -> Path:
    """A GGUF v3 header written by hand, so a test can say anything a file can (and no writer would)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, len(kvs) if kv_count is None else kv_count)
    path.write_bytes(head + b"".join(s(k) + v for k, v in kvs))
    return path


LLAMA = [("general.architecture", scalar(STRING, "llama")), ("llama.context_length", scalar(U32, 4096))]


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_inspect_cache()
    gguf_reader._open.cache_clear()
    yield
    gguf_reader._open.cache_clear()


# -- cost: arrays stay in the file -------------------------------------------------------------------


def _peak_bytes(call) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_big_metadata_arrays_cost_the_registry_no_object_per_element(tmp_path: Path) -> None:
    """1M strings and 2M numbers (18 MiB of arrays): opening the header and the registry's whole
    inspection allocate a few MiB at most (the sha256's read buffer), where reading every element
    took hundreds of MB."""
    count, numbers = 1 << 20, 1 << 21
    path = gguf(tmp_path / "big.gguf", [*LLAMA, ("tokenizer.ggml.tokens", array(STRING, count, strings(count))),
                                        ("big.numbers", array(U32, numbers, np.arange(numbers, dtype="<u4").tobytes())),
                                        ("general.name", scalar(STRING, "big"))])
    reader, peak = _peak_bytes(lambda: open_gguf(path))
    assert peak < 2 << 20, f"opening the header allocated {peak / 2**20:.1f} MiB"
    assert reader.fields["general.name"].contents() == "big"  # keys after the arrays were read too
    gguf_reader._open.cache_clear()
    meta, peak = _peak_bytes(lambda: inspect_model(path))
    assert (meta.architecture, meta.context_length) == ("llama", 4096)
    assert peak < 4 << 20, f"inspecting the weights allocated {peak / 2**20:.1f} MiB"
    # The worker's path still reads them, whole or one element, and their lengths without reading.
    tokens, numbers_field = reader.fields["tokenizer.ggml.tokens"], reader.fields["big.numbers"]
    assert (tokens.length, numbers_field.length) == (count, numbers)
    assert tokens.contents(7) == "ab" and numbers_field.contents(12345) == 12345
    assert numbers_field.contents(slice(3, 6)) == [3, 4, 5]
    assert tokens.contents() == ["ab"] * count
    assert numbers_field.contents()[-1] == numbers - 1


def test_arrays_are_not_kept_by_the_per_process_cache(tmp_path: Path) -> None:
    """`contents()` reads the array each time: the cached reader holds its place in the file, not a
    list, so the registry's cache of four files holds no arrays either."""
    path = gguf(tmp_path / "t.gguf", [*LLAMA, ("tokenizer.ggml.tokens", array(STRING, 3, strings(3, b"xyz")))])
    field = open_gguf(path).fields["tokenizer.ggml.tokens"]
    first = field.contents()
    first.append("changed")
    assert field.contents() == ["xyz"] * 3 and field.contents() is not first


def test_long_strings_are_read_when_asked_and_checked_then(tmp_path: Path) -> None:
    template = "{% for m in messages %}" * 1000  # a long chat template: 23 KB
    path = gguf(tmp_path / "t.gguf", [*LLAMA, ("tokenizer.chat_template", scalar(STRING, template)),
                                      ("bad.text", scalar(STRING, b"\xff" * 5000))])
    fields = open_gguf(path).fields
    assert fields["tokenizer.chat_template"].contents() == template
    with pytest.raises(gguf_reader.GGUFFormatError, match=r"bad\.text is not valid UTF-8"):
        fields["bad.text"].contents()


# -- bounds: a 400 naming the file and the key, nothing recorded -------------------------------------


OVER = {
    "keys": ([], {"kv_count": gguf_reader.MAX_KEYS + 1}, "the number of metadata keys"),
    "key length": ([(b"k", b"")], {}, "a metadata key's length"),  # rewritten below: a declared length
    "string length": ([("general.name", struct.pack("<IQ", STRING, gguf_reader.MAX_STRING_BYTES + 1))], {},
                      "a string's length (general.name)"),
    "array length": ([("tokenizer.ggml.tokens", array(U8, gguf_reader.MAX_ARRAY_LENGTH + 1))], {},
                     "an array's length (tokenizer.ggml.tokens)"),
    "string in an array": ([("tokenizer.ggml.merges", array(STRING, 2, s("a b") + struct.pack(
        "<Q", gguf_reader.MAX_STRING_BYTES + 1)))], {}, "a string's length (tokenizer.ggml.merges)"),
    "nesting": ([("deep", struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", ARRAY, 1)
                  + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", U8, 0))], {},
                "arrays' nesting depth (deep)"),
    "tensors": ([], {"tensor_count": gguf_reader.MAX_TENSORS + 1}, "the number of tensors"),
}


def _over_file(tmp_path: Path, case: str) -> tuple[Path, str]:
    kvs, options, what = OVER[case]
    path = tmp_path / f"{case.replace(' ', '-')}.gguf"
    if case == "key length":  # a key whose declared length is over the bound (its bytes need not follow)
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", gguf_reader.MAX_KEY_BYTES + 1)
        path.write_bytes(head + b"x" * 64)
    else:
        gguf(path, [*LLAMA, *kvs], **options)
    return path, what


@pytest.mark.parametrize("case", sorted(OVER))
def test_a_header_over_a_bound_is_a_400_naming_the_file_and_key(
        tmp_path: Path, sessions: sessionmaker[Session], case: str) -> None:
    path, what = _over_file(tmp_path, case)
    with pytest.raises(InvalidMetadata) as refused:
        inspect_model(path)
    message = str(refused.value)
    assert str(path) in message and what in message and "over this reader's bound" in message, message
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "source", "invalid_model_metadata")
    with sessions.begin() as session, pytest.raises(InvalidMetadata):
        register_model(session, path, actor="test")
    with sessions() as session:
        assert session.scalars(select(Model)).all() == []  # nothing recorded


@pytest.mark.parametrize("case", sorted(OVER))
def test_the_worker_refuses_the_same_files_in_one_line(tmp_path: Path, case: str) -> None:
    from inferplane.api.model_config import ModelLoadError
    from inferplane.worker.model.gguf_file import open_gguf as worker_open

    path, what = _over_file(tmp_path, case)
    with pytest.raises(ModelLoadError, match="over this reader's bound"):
        worker_open(str(path))


def test_a_key_twice_is_refused(tmp_path: Path) -> None:
    path = gguf(tmp_path / "twice.gguf", [*LLAMA, ("general.name", scalar(STRING, "a")),
                                          ("general.name", scalar(STRING, "b"))])
    with pytest.raises(gguf_reader.GGUFFormatError, match="general.name appears twice"):
        open_gguf(path)


def test_a_header_at_the_bounds_is_read(tmp_path: Path) -> None:
    """The bounds themselves are allowed: a longest key, an array of the most elements."""
    longest = "k" * gguf_reader.MAX_KEY_BYTES
    path = gguf(tmp_path / "edge.gguf", [*LLAMA, (longest, scalar(U32, 1)), ("a", array(
        U8, gguf_reader.MAX_ARRAY_LENGTH, bytes(gguf_reader.MAX_ARRAY_LENGTH)))])
    fields = open_gguf(path).fields
    assert fields[longest].contents() == 1 and fields["a"].length == gguf_reader.MAX_ARRAY_LENGTH
    assert inspect_model(path).context_length == 4096


def test_a_deep_tensor_is_refused_when_the_table_is_read(tmp_path: Path) -> None:
    """The registry reads no tensor table; the worker does, and a tensor of more than MAX_DIMS
    dimensions is refused there, naming it."""
    from inferplane.api.model_config import ModelLoadError
    from inferplane.worker.model.gguf_file import open_gguf as worker_open

    path = tmp_path / "dims.gguf"
    gguf(path, LLAMA, tensor_count=1)
    path.write_bytes(path.read_bytes() + s("w") + struct.pack("<I", 5) + struct.pack("<5Q", 1, 1, 1, 1, 1)
                     + struct.pack("<IQ", 0, 0) + bytes(64))
    assert inspect_model(path).architecture == "llama"
    with pytest.raises(ModelLoadError, match=r"the number of dimensions \(tensor w\) is 5"):
        worker_open(str(path))


# -- context length ----------------------------------------------------------------------------------


BAD_GGUF_CONTEXTS = {
    "negative": scalar(I32, -1), "zero": scalar(U32, 0), "over 2**24": scalar(U32, MAX_CONTEXT_LENGTH + 1),
    "64-bit": scalar(U64, 2**64 - 1), "float": scalar(F32, 4096.0), "string": scalar(STRING, "4096"),
    "bool": scalar(BOOL, True), "array": array(U32, 2, struct.pack("<II", 4096, 4096)),
}


@pytest.mark.parametrize("case", sorted(BAD_GGUF_CONTEXTS))
def test_an_absurd_gguf_context_length_is_a_400_naming_the_key(
        tmp_path: Path, sessions: sessionmaker[Session], case: str) -> None:
    path = gguf(tmp_path / "ctx.gguf", [("general.architecture", scalar(STRING, "llama")),
                                        ("llama.context_length", BAD_GGUF_CONTEXTS[case])])
    with sessions.begin() as session, pytest.raises(InvalidMetadata) as refused:
        register_model(session, path, actor="test")
    assert f"{path}: llama.context_length" in str(refused.value), str(refused.value)
    assert refused.value.param == "source"
    with sessions() as session:
        assert session.scalars(select(Model)).all() == []


@pytest.mark.parametrize(("kind", "value"), [(U32, 1), (U32, MAX_CONTEXT_LENGTH), (I64, 131072), (I32, 8192)])
def test_a_sane_gguf_context_length_is_recorded(tmp_path: Path, kind: int, value: int) -> None:
    path = gguf(tmp_path / "ctx.gguf", [("general.architecture", scalar(STRING, "llama")),
                                        ("llama.context_length", scalar(kind, value))])
    assert inspect_model(path).context_length == value


def _hf(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


@pytest.mark.parametrize("value", [-1, 0, MAX_CONTEXT_LENGTH + 1, 2**70, True, "4096", 4096.5, 1e30, [4096]])
@pytest.mark.parametrize("where", ["max_position_embeddings", "n_positions", "text_config.max_position_embeddings"])
def test_an_absurd_hf_context_length_is_a_400_naming_the_key(tmp_path: Path, value: object, where: str) -> None:
    config: dict = {"model_type": "llama"}
    if where.startswith("text_config."):
        config["text_config"] = {where.split(".", 1)[1]: value}
    else:
        config[where] = value
    folder = _hf(tmp_path, config)
    with pytest.raises(InvalidMetadata) as refused:
        inspect_model(folder)
    assert f"{folder / 'config.json'}: {where}" in str(refused.value), str(refused.value)


def test_a_sane_hf_context_length_is_recorded(tmp_path: Path) -> None:
    plain = _hf(tmp_path, {"model_type": "llama", "max_position_embeddings": 32768})
    assert inspect_model(plain).context_length == 32768
    nested = _hf(tmp_path, {"model_type": "gemma3", "text_config": {"max_position_embeddings": MAX_CONTEXT_LENGTH}})
    assert inspect_model(nested).context_length == MAX_CONTEXT_LENGTH


def test_a_huge_config_json_is_refused_unread(tmp_path: Path) -> None:
    folder = _hf(tmp_path, {"model_type": "llama"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "pad": [0] * (3 << 20)}))
    with pytest.raises(InvalidMetadata, match="config.json is .* bytes, over the registry's bound"):
        inspect_model(folder)


def test_an_over_bound_file_is_a_400_on_the_admin_api_too(tmp_path: Path) -> None:
    """End to end: the admin API answers 400 with `param: source` and the file's name, not 500."""
    import asyncio

    import httpx

    from inferplane.control_plane.gateway.rest import create_asgi_app
    from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

    root = tmp_path / "models"
    root.mkdir()
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key="ipadmin_" + "b" * 40,
                                      model_roots=(str(root),)))
    files = [gguf(root / "ctx.gguf", [("general.architecture", scalar(STRING, "llama")),
                                      ("llama.context_length", scalar(U64, 2**64 - 1))]),
             _over_file(root, "array length")[0]]

    async def post(source: Path) -> httpx.Response:
        transport = httpx.ASGITransport(create_asgi_app(gateway.context))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/admin/v1/models", json={"source": str(source)},
                                     headers={"authorization": "Bearer ipadmin_" + "b" * 40})

    try:
        for source in files:
            answer = asyncio.run(post(source))
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "source" and str(source) in error["message"], error
    finally:
        gateway.engine.dispose()


def test_invalid_metadata_is_invalid_input() -> None:
    assert issubclass(InvalidMetadata, InvalidInput)
