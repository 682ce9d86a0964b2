"""A tenant's LoRA adapter files read as untrusted input (api/lora_manifest.py, api/safetensors_file.py):
the whole safetensors file checked against the format, every value finite, the config's fields of
the right type and finite, tenants' patterns bounded (RE2), non-regular files refused without a
blocking open; each refusal an AdapterError (a 400 upstream) naming the adapter and the field."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from inferplane.api.lora_manifest import (
    CONFIG_FILE,
    MAX_PATTERN_CHARS,
    MAX_PATTERNS,
    WEIGHTS_FILE,
    AdapterError,
    BaseShape,
    read_manifest,
)
from inferplane.api.safetensors_file import FLOAT_DTYPES, MAX_HEADER_BYTES

BASE = BaseShape(num_layers=2, hidden_size=8, intermediate_size=16, q_size=8, kv_size=4)
RANK = 2
_NUMPY = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _values(dtype: str, count: int, seed: int = 0, special: float | None = None, at: int = 0) -> bytes:
    """`count` small random values of `dtype` as little-endian bytes; `special` written at index `at`."""
    values = np.random.default_rng(seed).normal(0, 0.1, count).astype(np.float32)
    if special is not None:
        values[at] = special
    if dtype == "BF16":  # bfloat16: the top half of a float32
        return (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype(np.dtype(_NUMPY[dtype]).newbyteorder("<")).tobytes()


def _module_tensors(dtype: str = "F32"):
    """PEFT-named lora_A [r, in] / lora_B [out, r] tensors of q_proj and v_proj in both layers:
    name -> (dtype, shape, bytes)."""
    tensors = {}
    for layer in (0, 1):
        for module in ("q_proj", "v_proj"):
            in_f, out_f = BASE.module_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for half, shape in (("A", (RANK, in_f)), ("B", (out_f, RANK))):
                tensors[f"{prefix}.lora_{half}.weight"] = (dtype, shape, _values(dtype, shape[0] * shape[1],
                                                                                  seed=len(tensors)))
    return tensors


def _safetensors(tensors, header_edit=None, tail: bytes = b"", pad: int = 0) -> bytes:
    """A safetensors file's bytes; `header_edit(header)` may change the header before it is written."""
    header, at, data = {}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        data += raw
    if header_edit is not None:
        header_edit(header)
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data + tail


def _adapter(folder: Path, *, config: dict | None = None, weights: bytes | None = None, **tensor_args) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "bias": "none"}
    settings.update(config or {})
    (folder / CONFIG_FILE).write_text(json.dumps(settings))
    if weights is None:
        weights = _safetensors(_module_tensors(**tensor_args))
    (folder / WEIGHTS_FILE).write_bytes(weights)
    return folder


def _read(folder: Path, values: bool = True):
    manifest = read_manifest(folder, "bot")
    manifest.check(BASE, max_rank=8)
    if values:
        manifest.check_values()
    return manifest


@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
def test_a_sound_adapter_of_each_float_dtype_is_read_and_its_values_match(tmp_path, dtype):
    folder = _adapter(tmp_path / "ok", dtype=dtype)
    manifest = _read(folder)
    assert manifest.rank == RANK and len(manifest.modules) == 4
    assert {e.scaling for e in manifest.modules.values()} == {4 / RANK}
    read = {name: (info, data) for name, info, data in manifest.read_tensors()}
    expected = _module_tensors(dtype)
    assert set(read) == set(expected)
    assert all(bytes(read[n][1]) == expected[n][2] and read[n][0].shape == expected[n][1] for n in expected)


@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("half,at", [("A", 0), ("B", 7)])
def test_a_non_finite_value_anywhere_is_refused_naming_the_tensor(tmp_path, dtype, value, half, at):
    name = f"base_model.model.model.layers.1.self_attn.v_proj.lora_{half}.weight"
    tensors = _module_tensors(dtype)
    raw = bytearray(tensors[name][2])
    special = bytearray(_values(dtype, 8, special=value, at=at))
    itemsize = FLOAT_DTYPES[dtype][0]
    raw[at * itemsize:(at + 1) * itemsize] = special[at * itemsize:(at + 1) * itemsize]
    tensors[name] = (tensors[name][0], tensors[name][1], bytes(raw))
    folder = _adapter(tmp_path / "bad", weights=_safetensors(tensors))
    manifest = _read(folder, values=False)  # the form is fine: the values are not
    with pytest.raises(AdapterError, match=rf"adapter 'bot': {WEIGHTS_FILE}: tensor {name} holds an infinity or a NaN"):
        manifest.check_values()
    with pytest.raises(AdapterError, match="holds an infinity or a NaN"):
        list(manifest.read_tensors())


FIRST = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # shape (2, 8): 64 bytes of F32
SECOND = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"  # shape (8, 2): bytes 64 to 128


def _edit(name: str = FIRST, **changes):
    """A header edit: one tensor's fields replaced by `changes`."""
    def edit(header):
        header[name].update(changes)
    return edit


@pytest.mark.parametrize("edit,message", [
    (_edit(dtype="I32"), "dtype 'I32' is not served"),
    (_edit(dtype="F8_E4M3"), "dtype 'F8_E4M3' is not served"),
    (_edit(dtype=5), "dtype '5' is not served"),
    (_edit(shape=[-2, 8]), "shape must be a list"),
    (_edit(shape=[2.0, 8]), "shape must be a list"),
    (_edit(shape=["2", 8]), "shape must be a list"),
    (_edit(shape=[True, 8]), "shape must be a list"),
    (_edit(shape=[2**40, 8]), "shape must be a list"),
    (_edit(shape=[2**31, 8]), "do not hold a F32 tensor of shape"),  # rank 2^31: not what the bytes hold
    (_edit(shape=[[2], 8]), "shape must be a list"),
    (_edit(shape="2,8"), "shape must be a list"),
    (_edit(data_offsets=[0, 60]), "do not hold a F32 tensor"),
    (_edit(data_offsets=[0, -64]), "data_offsets must be two non-negative whole numbers"),
    (_edit(data_offsets=[0, 64.0]), "data_offsets must be two non-negative whole numbers"),
    (_edit(data_offsets=[0]), "data_offsets must be two non-negative whole numbers"),
    (_edit(SECOND, data_offsets=[32, 96]), "overlaps the tensor before it"),
    (_edit(data_offsets=[2**40, 2**40 + 64]), "leaves a gap before it"),
    (_edit(extra=1), "must be an object of dtype, shape and data_offsets"),
    (lambda h: h.update({"__metadata__": {"format": 1}}), "__metadata__ must be an object of strings"),
    (lambda h: h.update({"x": [1, 2]}), "tensor x must be an object"),
])
def test_a_header_that_breaks_the_format_is_refused_naming_the_field(tmp_path, edit, message):
    folder = _adapter(tmp_path / "bad", weights=_safetensors(_module_tensors(), header_edit=edit))
    with pytest.raises(AdapterError, match=rf"^adapter 'bot': {WEIGHTS_FILE}: .*{message}"):
        read_manifest(folder, "bot")


def test_offsets_that_skip_or_outrun_the_data_and_a_file_of_another_size_are_refused(tmp_path):
    tensors = _module_tensors()
    cases = {
        "trailing": _safetensors(tensors, tail=b"\0" * 8),  # 8 bytes no tensor owns
        "short": _safetensors(tensors)[:-4],  # the last tensor cut
        "gap": _safetensors(tensors, header_edit=lambda h: h[FIRST].update(data_offsets=[8, 72])),
    }
    for label, raw in cases.items():
        folder = _adapter(tmp_path / label, weights=raw)
        with pytest.raises(AdapterError, match="data_offsets must tile|the file has"):
            read_manifest(folder, "bot")


@pytest.mark.parametrize("raw,message", [
    (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", f"at most {MAX_HEADER_BYTES} are read"),
    (struct.pack("<Q", 26 << 20) + b"{}", f"at most {MAX_HEADER_BYTES} are read"),
    (struct.pack("<Q", 2**63) + b"{}", f"at most {MAX_HEADER_BYTES} are read"),
    (struct.pack("<Q", 100) + b"{}", "runs past the end of the file"),
    (b"\1\0", "shorter than its 8-byte header length"),
    (struct.pack("<Q", 5) + b"[1,2]", "the header must be a JSON object"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "the header is not valid JSON"),
    (struct.pack("<Q", 9) + b'{"a":NaN}', "the header is not valid JSON"),
    (struct.pack("<Q", 15) + b'{"a":{},"a":{}}', "appears twice"),
    (struct.pack("<Q", 200_000) + b"[" * 200_000, "the header is not valid JSON"),  # no RecursionError
])
def test_a_header_that_is_not_a_bounded_json_object_is_refused(tmp_path, raw, message):
    folder = _adapter(tmp_path / "bad", weights=raw)
    with pytest.raises(AdapterError, match=message):
        read_manifest(folder, "bot")


def test_a_header_above_the_bound_is_refused_though_it_is_well_formed(tmp_path):
    """The format allows padding; a 2 MiB header of it is still far more than any PEFT header."""
    folder = _adapter(tmp_path / "padded", weights=_safetensors(_module_tensors(), pad=2 << 20))
    with pytest.raises(AdapterError, match=f"at most {MAX_HEADER_BYTES} are read"):
        read_manifest(folder, "bot")
    folder = _adapter(tmp_path / "fine", weights=_safetensors(_module_tensors(), pad=1000))
    _read(folder)


def test_a_layer_number_of_thousands_of_digits_is_an_adapter_error(tmp_path):
    name = f"base_model.model.model.layers.{'9' * 5000}.self_attn.q_proj.lora_A.weight"
    tensors = {name: ("F32", (RANK, 8), _values("F32", RANK * 8))}
    folder = _adapter(tmp_path / "layer", weights=_safetensors(tensors))
    with pytest.raises(AdapterError, match=r"is not a LoRA weight of a served module"):
        read_manifest(folder, "bot")


@pytest.mark.parametrize("field,value,message", [
    ("lora_alpha", "16", "lora_alpha must be a number, not str"),
    ("lora_alpha", True, "lora_alpha must be a number, not bool"),
    ("lora_alpha", [16], "lora_alpha must be a number, not list"),
    ("lora_alpha", math.nan, "lora_alpha must be a finite number"),
    ("lora_alpha", math.inf, "lora_alpha must be a finite number"),
    ("lora_alpha", -math.inf, "lora_alpha must be a finite number"),
    ("lora_alpha", 10**400, "lora_alpha must be a finite number"),
    ("r", 0, "r must be a whole number of at least 1"),
    ("r", "8", "r must be a whole number of at least 1"),
    ("r", True, "r must be a whole number of at least 1"),
    ("use_rslora", "yes", "use_rslora must be true or false"),
    ("use_dora", "false", "use_dora must be true or false"),
    ("peft_type", ["LORA"], "peft_type .* is not served"),
    ("bias", 0, "bias must be a string"),
    ("modules_to_save", "lm_head", "modules_to_save must be a list"),
    ("alpha_pattern", ["q_proj"], "alpha_pattern must be an object of pattern -> value"),
    ("alpha_pattern", {"q_proj": "8"}, r"alpha_pattern\['q_proj'\] must be a number"),
    ("alpha_pattern", {"q_proj": math.inf}, r"alpha_pattern\['q_proj'\] must be a finite number"),
    ("alpha_pattern", {"q_proj": False}, r"alpha_pattern\['q_proj'\] must be a number, not bool"),
    ("rank_pattern", {"q_proj": 0}, r"rank_pattern\['q_proj'\] must be a whole number"),
    ("rank_pattern", {"q_proj": 2.5}, r"rank_pattern\['q_proj'\] must be a whole number"),
    ("rank_pattern", "q_proj", "rank_pattern must be an object"),
])
def test_config_fields_of_the_wrong_type_or_not_finite_are_refused_naming_them(tmp_path, field, value, message):
    folder = _adapter(tmp_path / "bad")
    config = json.loads((folder / CONFIG_FILE).read_text())
    config[field] = value
    (folder / CONFIG_FILE).write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    with pytest.raises(AdapterError, match=rf"^adapter 'bot': {message}"):
        read_manifest(folder, "bot")


@pytest.mark.parametrize("field", ["alpha_pattern", "rank_pattern"])
@pytest.mark.parametrize("key,message", [
    ("(q_proj", "is not a pattern served here"),
    ("q_proj)|(.*", "is not a pattern served here"),  # may not close the group around it
    ("(?=q)q_proj", "no look-around or backreferences"),  # Python's re takes it, RE2 does not
    (r"(q)\1_proj", "no look-around or backreferences"),
    ("q" * (MAX_PATTERN_CHARS + 1), f"longer than {MAX_PATTERN_CHARS} characters"),
    (r"\pL{1000}", "is not a pattern served here"),  # RE2's memory bound: compiling it would take more
])
def test_invalid_or_unbounded_patterns_are_refused_naming_the_field(tmp_path, field, key, message):
    value = 2 if field == "rank_pattern" else 8
    folder = _adapter(tmp_path / "bad", config={field: {key: value}})
    with pytest.raises(AdapterError, match=rf"^adapter 'bot': {field}: the key .*{message}"):
        read_manifest(folder, "bot")


def test_at_most_so_many_patterns(tmp_path):
    many = {f"layers\\.{i}\\.q_proj": 8 for i in range(MAX_PATTERNS + 1)}
    folder = _adapter(tmp_path / "many", config={"alpha_pattern": many})
    with pytest.raises(AdapterError, match=f"alpha_pattern has {MAX_PATTERNS + 1} patterns; at most {MAX_PATTERNS}"):
        read_manifest(folder, "bot")
    del many[next(iter(many))]
    _adapter(tmp_path / "many", config={"alpha_pattern": many})
    _read(tmp_path / "many")


def test_alpha_pattern_scales_as_peft_does(tmp_path):
    """PEFT's get_pattern_key is the oracle: the first key matching the module's name in full or
    after a dot wins (not the last; a bare suffix such as 'proj' matches no name)."""
    peft_other = pytest.importorskip("peft.utils.other")
    patterns = {r"layers\.1\.self_attn\.q_proj": 32, "q_proj": 6, "proj": 100, "v_.*|k_proj": 12,
                r"model\.layers\.0\.self_attn\.v_proj": 50}
    folder = _adapter(tmp_path / "patterns", config={"alpha_pattern": patterns, "lora_alpha": 4})
    manifest = _read(folder)
    for (layer, module), entry in manifest.modules.items():
        name = f"model.layers.{layer}.self_attn.{module}"
        key = peft_other.get_pattern_key(list(patterns), name)
        expected = patterns.get(key, 4)
        assert entry.scaling == expected / RANK, (name, key)


def test_a_catastrophic_pattern_runs_in_linear_time(tmp_path):
    """A pattern that makes Python's re backtrack for hours on a module name (the attacker's held
    the GIL for 4.6 s): read in a child process that must finish within a generous bound."""
    folder = _adapter(tmp_path / "slow", config={"alpha_pattern": {"([a-z_.0-9]+)+z": 8, "(.*)*z": 8},
                                                 "rank_pattern": {"([a-z_.0-9]+)+z": 2}})
    code = ("import sys; from inferplane.api.lora_manifest import read_manifest; "
            "m = read_manifest(sys.argv[1], 'bot'); print(sorted({e.scaling for e in m.modules.values()}))")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([4 / RANK])  # neither pattern matches any module name


def _in_thread(fn, timeout: float = 60):
    """fn()'s exception (or None) from a thread joined within `timeout`; a hang fails the test."""
    caught: list[BaseException | None] = []

    def run():
        try:
            fn()
            caught.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, caught


@pytest.mark.parametrize("which", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_fifo_or_a_device_in_place_of_a_file_is_refused_without_hanging(tmp_path, which):
    folder = _adapter(tmp_path / "fifo")
    (folder / which).unlink()
    os.mkfifo(folder / which)
    thread, caught = _in_thread(lambda: read_manifest(folder, "bot"))
    if thread.is_alive():  # blocked in open(): give it a writer so the thread can end, then fail
        with open(folder / which, "wb"):
            pass
        thread.join(10)
        pytest.fail(f"reading an adapter whose {which} is a FIFO hung")
    assert isinstance(caught[0], AdapterError) and f"{which} is not a regular file" in str(caught[0])
    (folder / which).unlink()
    (folder / which).symlink_to("/dev/zero")  # a device through a symlink
    with pytest.raises(AdapterError, match=f"{which} is not a regular file"):
        read_manifest(folder, "bot")
    (folder / which).unlink()
    (folder / which).mkdir()
    with pytest.raises(AdapterError, match=f"{which} is not a regular file"):
        read_manifest(folder, "bot")


def test_a_nul_byte_in_the_path_is_an_adapter_error(tmp_path):
    with pytest.raises(AdapterError, match="NUL byte"):
        read_manifest(f"{tmp_path}/a\x00b", "bot")


def test_an_oversized_config_is_refused(tmp_path):
    folder = _adapter(tmp_path / "big", config={"notes": "x" * (1 << 20)})
    with pytest.raises(AdapterError, match=f"{CONFIG_FILE} is larger than"):
        read_manifest(folder, "bot")
