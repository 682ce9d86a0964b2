"""The worker's side of reading a tenant's adapter: the same rule as the registry
(api/lora_manifest.py) on the very bytes it loads, a refusal remembered until the files change (a
bad adapter costs one read, not one per request), and each refusal an AdapterError naming it."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferplane.api.model_config import read_model_config
from inferplane.bench.lora import write_random_adapter
from inferplane.worker.lora import AdapterError, LoraRequest, load_adapter
from inferplane.worker.lora import catalog as catalog_module
from inferplane.worker.lora import sources as sources_module
from inferplane.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from inferplane.worker.lora.catalog import AdapterCatalog
from inferplane.worker.lora.sources import AdapterSource

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def config(tiny_llama):
    return read_model_config(tiny_llama)


def _adapter(folder, config, rank: int = 4, **config_changes):
    write_random_adapter(folder, config, rank, TARGETS, seed=3, b_scale=0.3)
    if config_changes:
        settings = json.loads((folder / CONFIG_FILE).read_text())
        settings.update(config_changes)
        (folder / CONFIG_FILE).write_text(json.dumps(settings))
    return folder


def _poison(folder, half: str, value: float) -> None:
    """One value of one tensor set to `value`, the file saved again (safetensors writes it happily)."""
    tensors = load_file(str(folder / WEIGHTS_FILE))
    name = sorted(n for n in tensors if f"lora_{half}" in n)[-1]
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(folder / WEIGHTS_FILE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("half,value", [("B", math.nan), ("A", math.inf), ("B", -math.inf)])
def test_non_finite_weights_are_refused_at_load(tmp_path, config, half, value, dtype):
    folder = _adapter(tmp_path / "bad", config)
    if dtype != torch.float32:  # the file's own dtype: the check reads each dtype's bits
        tensors = {k: v.to(dtype) for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
        save_file(tensors, str(folder / WEIGHTS_FILE))
    _poison(folder, half, value)
    with pytest.raises(AdapterError, match=rf"adapter 'bad': {WEIGHTS_FILE}: tensor .*lora_{half}.* holds an "
                                           "infinity or a NaN"):
        load_adapter(LoraRequest("bad", str(folder)), config, 8)


def test_a_scaling_that_overflows_the_replicas_dtype_is_refused(tmp_path, config):
    """Finite in the file, infinite once lora_alpha / r multiplies B in the serving dtype."""
    folder = _adapter(tmp_path / "loud", config, lora_alpha=1e300)
    with pytest.raises(AdapterError, match=r"adapter 'loud': layer 0 \w+_proj: its weights .* overflow this "
                                           r"replica's float32"):
        load_adapter(LoraRequest("loud", str(folder)), config, 8)
    folder = _adapter(tmp_path / "fine", config, lora_alpha=1e3)
    adapter = load_adapter(LoraRequest("fine", str(folder)), config, 8)
    assert all(torch.isfinite(b).all() for _, b in adapter.weights.values())


def test_a_rank_above_the_replicas_maximum_is_an_adapter_error_naming_it(tmp_path, config):
    folder = _adapter(tmp_path / "wide", config, rank=16)
    with pytest.raises(AdapterError, match=r"adapter 'wide': layer 0 \w+_proj has rank 16, above max_lora_rank 8"):
        load_adapter(LoraRequest("wide", str(folder)), config, 8)


def test_a_nul_byte_in_a_request_is_an_adapter_error():
    for name, path in (("a\x00b", "/tmp/x"), ("ab", "/tmp/\x00x")):
        with pytest.raises(AdapterError, match="NUL byte"):
            LoraRequest(name, path)


def _counting(monkeypatch, module, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_refused_adapter_is_read_once_until_its_files_change(tmp_path, config, monkeypatch):
    reads = _counting(monkeypatch, catalog_module, "load_adapter")
    catalog = AdapterCatalog(config, 8, torch.float32, torch.device("cpu"))
    folder = _adapter(tmp_path / "bad", config)
    _poison(folder, "B", math.nan)
    request = LoraRequest("bad", str(folder))
    errors = []
    for _ in range(3):
        with pytest.raises(AdapterError) as err:
            catalog.get(request)
        errors.append(str(err.value))
    assert reads[0] == 1 and len(set(errors)) == 1 and "holds an infinity or a NaN" in errors[0]
    settings = json.loads((folder / CONFIG_FILE).read_text())  # a new version of the config alone
    (folder / CONFIG_FILE).write_text(json.dumps({**settings, "lora_alpha": "8"}))
    with pytest.raises(AdapterError, match="lora_alpha must be a number"):
        catalog.get(request)
    assert reads[0] == 2
    _adapter(folder, config)  # fixed: both files written again
    assert catalog.get(request).name == "bad" and reads[0] == 3
    catalog.get(request)
    assert reads[0] == 3


def test_a_local_adapter_that_misses_its_digest_is_hashed_once_until_it_changes(tmp_path, config, monkeypatch):
    fetches = _counting(monkeypatch, sources_module, "fetch_model")
    folder = _adapter(tmp_path / "drifted", config)
    source = AdapterSource(AdapterCatalog(config, 8, torch.float32, torch.device("cpu")), cache_root=tmp_path / "c")
    for _ in range(3):
        with pytest.raises(AdapterError, match="adapter 'drifted': digest mismatch"):
            source.adapter("drifted", f"file://{folder}", "0" * 64)
    assert fetches[0] == 1
    os.utime(folder / WEIGHTS_FILE, ns=(1, 1))  # another version of a file in it
    with pytest.raises(AdapterError, match="digest mismatch"):
        source.adapter("drifted", f"file://{folder}", "0" * 64)
    assert fetches[0] == 2
