"""LoRA adapters over a shared base: rows of several adapters and of the base in one batch give the
tokens of each adapter's merged model (peft's merge, HF transformers as the oracle)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from inferplane import LLM, SamplingParams
from inferplane.worker.lora import AdapterError, LoraRequest
from tests.worker.conftest import hf_greedy, one_kernel_for_every_row_count, prompts_of_lengths, save_tiny

# (rank, target modules): attention only, everything, MLP only, a pair; ranks 8 and 16 as the issue asks
ADAPTERS = [(8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            (16, ["gate_proj", "up_proj", "down_proj"]),
            (8, ["q_proj", "v_proj"])]
LENGTHS = [5, 17, 33, 40, 9, 64]
NEW_TOKENS = 12


def make_adapter(base: str, folder: str, rank: int, targets: list[str], seed: int) -> str:
    """A random PEFT adapter saved to `folder`, and its merged model to `folder`-merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False))
    with torch.no_grad():  # peft starts B at zero (or tiny): big enough to change the tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    peft_model.merge_and_unload().save_pretrained(f"{folder}-merged")
    return folder


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny(root / "base", "llama", seed=1)
    adapters = [make_adapter(base, str(root / f"adapter{i}"), rank, targets, seed=20 + i)
                for i, (rank, targets) in enumerate(ADAPTERS)]
    prompts = prompts_of_lengths(LENGTHS, vocab=320, seed=3)
    expected = {None: hf_greedy(base, prompts, NEW_TOKENS)}
    for folder in adapters:
        expected[folder] = hf_greedy(f"{folder}-merged", prompts, NEW_TOKENS)
    return base, adapters, prompts, expected


def _mixed(adapters: list[str]) -> list[str | None]:
    """Per prompt: the four adapters and the base in turn."""
    order = [*adapters, None]
    return [order[i % len(order)] for i in range(len(LENGTHS) * 2)]


def _greedy(llm: LLM, prompts, folders):
    requests = [None if f is None else LoraRequest(os.path.basename(f), f) for f in folders]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=requests)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("runtime,options", [
    ("paged", {}),
    ("radix", {}),
    # chunked prefill and preemption: 16 blocks of 8 hold the longest request and little more
    ("paged", {"num_kv_blocks": 16, "block_size": 8, "max_num_batched_tokens": 32}),
])
def test_mixed_batch_equals_each_merged_model(lora_setup, runtime, options):
    base, adapters, prompts, expected = lora_setup
    folders = _mixed(adapters)
    # two slots for four adapters: rows wait for a slot, slots are evicted least recently used
    llm = LLM(base, runtime=runtime, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, **options)
    ours = _greedy(llm, prompts * 2, folders)
    want = [expected[f][i % len(prompts)] for i, f in enumerate(folders)]
    assert ours == want
    stats = llm.stats()
    assert stats["lora_loads_total"] >= 4 and stats["lora_evictions_total"] >= 2
    assert stats["lora_slots_pinned"] == 0
    assert {k: v for k, v in stats.items() if k.startswith("lora_requests:")} == {
        f"lora_requests:adapter{i}": 3.0 if i < 2 else 2.0 for i in range(4)}
    if "num_kv_blocks" in options:
        assert stats["preemptions"] > 0


def test_all_adapters_in_one_step(lora_setup):
    """Four slots: every adapter and the base share each step (the gathered path, no waiting)."""
    base, adapters, prompts, expected = lora_setup
    folders = _mixed(adapters)
    llm = LLM(base, device="cpu", dtype="float32", max_loras=4, max_lora_rank=16)
    ours = _greedy(llm, prompts * 2, folders)
    assert ours == [expected[f][i % len(prompts)] for i, f in enumerate(folders)]
    assert llm.stats()["lora_evictions_total"] == 0


def test_prefix_cache_never_crosses_adapters(lora_setup):
    base, adapters, prompts, _ = lora_setup
    llm = LLM(base, runtime="radix", device="cpu", dtype="float32", max_loras=2, block_size=8)
    prompt = prompts[-1]  # 64 tokens: seven full blocks to reuse
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    a, b = (LoraRequest(f"adapter{i}", adapters[i]) for i in (0, 1))
    assert llm.generate([prompt], params, lora_request=a)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0  # the base
    assert llm.generate([prompt], params, lora_request=a)[0].num_cached_tokens > 0  # the same adapter: a hit


def test_new_version_of_a_name_serves_the_new_weights(lora_setup, tmp_path):
    base, adapters, prompts, expected = lora_setup
    folder = tmp_path / "rolling"
    shutil.copytree(adapters[0], folder)
    llm = LLM(base, runtime="radix", device="cpu", dtype="float32", max_loras=2, max_lora_rank=16)
    request = LoraRequest("rolling", str(folder))
    assert _greedy(llm, prompts, [str(folder)] * len(prompts)) == expected[adapters[0]]
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # version 2: the other adapter's files
        shutil.copy(os.path.join(adapters[1], name), folder / name)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=request)
    assert [o.token_ids for o in outs] == expected[adapters[1]]


def test_cpu_int8_with_adapters_is_as_close_as_the_quantized_merged_model(lora_setup):
    """cpu-int8 keeps the base int8 (q/k/v and gate/up fused, smoothed) and runs the adapter in
    float: its first-token logprobs are as close to the float merged model as quantizing that merged
    model itself is, and far closer than the base without the adapter."""
    base, adapters, prompts, _ = lora_setup
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=1, top_logprobs=5)

    def top(llm, folder=None):
        request = None if folder is None else LoraRequest(os.path.basename(folder), folder)
        outs = llm.generate(prompts, params, lora_request=[request] * len(prompts))
        return torch.tensor([[lp for _, lp in o.top_logprobs[0]] for o in outs])

    int8 = one_kernel_for_every_row_count(LLM(base, runtime="cpu-int8", device="cpu", max_loras=4, max_lora_rank=16,
                                              skip_quality_gate=True))
    for folder in adapters:
        reference = top(LLM(f"{folder}-merged", device="cpu", dtype="float32"))
        merged_int8 = one_kernel_for_every_row_count(LLM(f"{folder}-merged", runtime="cpu-int8", device="cpu",
                                                         skip_quality_gate=True))
        quantized_merged = (top(merged_int8) - reference).abs().mean().item()
        ours = (top(int8, folder) - reference).abs().mean().item()
        without = (top(int8) - reference).abs().mean().item()
        assert ours <= max(2 * quantized_merged, 0.05), (folder, ours, quantized_merged)
        assert ours < without / 2, (folder, ours, without)


def test_adapters_that_do_not_fit_are_refused_naming_what(lora_setup, tmp_path):
    base, adapters, prompts, _ = lora_setup
    llm = LLM(base, device="cpu", dtype="float32", max_loras=1, max_lora_rank=8)
    params = SamplingParams(max_tokens=1)
    with pytest.raises(AdapterError, match="rank 16, above max_lora_rank 8"):
        llm.generate(prompts[:1], params, lora_request=LoraRequest("big", adapters[1]))
    other = save_tiny(tmp_path / "other-base", "llama", seed=4)
    from transformers import AutoModelForCausalLM, LlamaConfig
    wide = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=128,
                                                        num_hidden_layers=3, num_attention_heads=4,
                                                        num_key_value_heads=2))
    wide.save_pretrained(tmp_path / "wide")
    misfit = make_adapter(str(tmp_path / "wide"), str(tmp_path / "misfit"), 8, ["q_proj"], seed=1)
    with pytest.raises(AdapterError, match=r"layer 0 q_proj: lora_A \(8, 96\).*do not fit the base's 64 -> 64"):
        llm.generate(prompts[:1], params, lora_request=LoraRequest("misfit", misfit))
    head = make_adapter(other, str(tmp_path / "head"), 8, ["lm_head"], seed=2)
    with pytest.raises(AdapterError, match="not a LoRA weight of a served module"):
        llm.generate(prompts[:1], params, lora_request=LoraRequest("head", head))
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        os.makedirs(tmp_path / "empty")
        (tmp_path / "empty" / "adapter_model.safetensors").write_bytes(b"")
        llm.generate(prompts[:1], params, lora_request=LoraRequest("empty", str(tmp_path / "empty")))
    plain = LLM(base, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="max_loras"):
        plain.generate(prompts[:1], params, lora_request=LoraRequest("a", adapters[0]))
    # nothing was left queued by the refusals
    assert not llm.engine.has_unfinished() and llm.stats()["lora_slots_pinned"] == 0


def test_worker_serves_adapters_by_uri_over_grpc(lora_setup, tmp_path):
    """The worker process: one adapter preloaded (in its slot before the worker serves), requests
    name their adapter by URI and digest; rows of two adapters and the base stream concurrently,
    each with its merged model's tokens; a digest that does not match, a rank above the replica's
    max_lora_rank and a NaN in the weights are each an INVALID_ARGUMENT naming the request's model
    field and the adapter (the gateway's 400 with param "model"), never an internal error."""
    import grpc

    from inferplane.storage.digest import digest
    from inferplane.v1 import worker_pb2, worker_pb2_grpc
    from tests.worker.test_worker_process import SERVING, health, start_worker, wait_for

    base, adapters, prompts, expected = lora_setup
    proc, port = start_worker(base, "--device", "cpu", "--dtype", "float32", "--max-loras", "2",
                              "--max-lora-rank", "16", "--preload-adapter",
                              f"adapter0=file://{adapters[0]}#{digest(adapters[0])}")
    try:
        from grpc_health.v1 import health_pb2_grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_for(lambda: health(health_pb2_grpc.HealthStub(channel)) == SERVING, 180, "SERVING")
        stub = worker_pb2_grpc.WorkerStub(channel)
        preloaded = stub.Stats(worker_pb2.StatsRequest()).values  # loaded before serving
        assert preloaded["lora_loads_total"] == 1 and preloaded["lora_loaded:adapter0"] == 1

        def generate(prompt, folder=None, sha256=None):
            ref = None
            if folder is not None:
                ref = worker_pb2.Adapter(name=os.path.basename(folder), uri=f"file://{folder}",
                                         sha256=sha256 or digest(folder))
            req = worker_pb2.GenerateRequest(token_ids=worker_pb2.TokenIds(ids=prompt), adapter=ref,
                                             params=worker_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                              ignore_eos=True))
            return stub.Generate(req, timeout=120)

        streams = [(i, f, generate(prompts[i], f)) for i, f in
                   enumerate([adapters[0], adapters[1], None, adapters[0], adapters[1], None])]
        for i, folder, stream in streams:
            tokens = [t for chunk in stream for t in chunk.token_ids]
            assert tokens == expected[folder][i], (i, folder)
        with pytest.raises(grpc.RpcError) as err:
            list(generate(prompts[0], adapters[2], sha256="0" * 64))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("model: adapter 'adapter2': digest mismatch")
        from safetensors.torch import load_file, save_file

        from inferplane.api.model_config import read_model_config
        from inferplane.bench.lora import write_random_adapter

        wide = write_random_adapter(tmp_path / "wide", read_model_config(base), 32, ["q_proj"], seed=5)
        nan = tmp_path / "nan"
        shutil.copytree(adapters[0], nan)
        tensors = load_file(str(nan / "adapter_model.safetensors"))
        next(t for n, t in sorted(tensors.items()) if "lora_B" in n).view(-1)[0] = float("nan")
        save_file(tensors, str(nan / "adapter_model.safetensors"))
        for folder, words in ((str(wide), "has rank 32, above max_lora_rank 16"),
                              (str(nan), "holds an infinity or a NaN")):
            for _ in range(2):  # the second answered from the refusal the worker keeps
                with pytest.raises(grpc.RpcError) as err:
                    list(generate(prompts[0], folder))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(f"model: adapter '{os.path.basename(folder)}': ")
                assert words in err.value.details()
        stats = stub.Stats(worker_pb2.StatsRequest()).values
        assert stats["lora_loads_total"] == 2 and stats["lora_slots"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_bench_lora_measures_and_prints_ratios(lora_setup, capsys):
    """`inferplane bench lora` on the tiny base: all three contenders run and the ratios print."""
    from inferplane.bench.lora import main

    base = lora_setup[0]
    assert main(["--model", base, "--adapters", "3", "--rank", "4", "--requests", "6", "--prompt-tokens", "8",
                 "--new-tokens", "4", "--rounds", "1", "--targets", "q_proj,down_proj"]) == 0
    out = capsys.readouterr().out
    for line in ("mixed / base", "mixed / merged", "first request to an unloaded adapter", "loads 4, evictions 1"):
        assert line in out, out


def test_a_request_whose_adapter_finds_every_slot_pinned_waits_and_others_go_ahead(lora_setup):
    """One slot, pinned by adapter 0's running request: adapter 1's request waits (counted as waiting
    for a slot) while the base's request is admitted; when adapter 0's finishes, adapter 1 loads."""
    from inferplane.worker.lora import load_adapter

    base, adapters, prompts, expected = lora_setup
    llm = LLM(base, device="cpu", dtype="float32", max_loras=1, max_lora_rank=16)
    engine = llm.engine
    first, second = (load_adapter(LoraRequest(f"adapter{i}", adapters[i]), engine.loaded.config, 16) for i in (0, 1))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    a = engine.add_request(prompts[0], params, adapter=first)
    b = engine.add_request(prompts[1], params, adapter=second)
    c = engine.add_request(prompts[2], params)
    engine.step()
    stats = engine.stats()
    assert (a.status.value, b.status.value, c.status.value) == ("running", "waiting", "running")
    assert stats["lora_waiting"] == 1 and stats["lora_slots_pinned"] == 1 and "lora_loaded:adapter0" in stats
    while engine.has_unfinished():
        engine.step()
    assert (a.output_token_ids, b.output_token_ids, c.output_token_ids) == (
        expected[adapters[0]][0], expected[adapters[1]][1], expected[None][2])
    stats = engine.stats()
    assert stats["lora_waiting"] == 0 and stats["lora_evictions_total"] == 1 and "lora_loaded:adapter1" in stats


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory):
    """Two peft adapters on SmolLM2 as transformers loads it from the GGUF file (q,k,v,o and MLP
    targets, ranks 8 and 16), each merged model saved beside it; and the prompts."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferplane.api.model_resolution import builtin_model_path

    gguf = builtin_model_path("smollm2-135m")
    root = tmp_path_factory.mktemp("smollm2-lora")
    # transformers will not save a model it read from GGUF: the same weights as a plain model
    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = from_gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = from_gguf.state_dict()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    folders = []
    for i, (rank, targets) in enumerate([(8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                         (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])]):
        torch.manual_seed(40 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      init_lora_weights=False))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
        folder = root / f"smol{i}"
        peft_model.save_pretrained(str(folder))
        peft_model.merge_and_unload().save_pretrained(str(folder) + "-merged")
        tokenizer.save_pretrained(str(folder) + "-merged")  # cpu-int8 calibrates on text with it
        folders.append(str(folder))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
             "The chemical symbol for gold is", "Water boils at"]
    return folders, [tokenizer.encode(t) for t in texts]


@pytest.mark.slow
def test_smollm2_adapters_and_the_base_in_one_batch_equal_each_merged_model(smollm2_adapters):
    folders, prompts = smollm2_adapters
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", max_loras=2, max_lora_rank=16)
    which = [folders[0], folders[1], None] * 2
    requests = [None if f is None else LoraRequest(os.path.basename(f), f) for f in which]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        lora_request=requests)
    expected = {None: hf_greedy(llm_reference("smollm2-135m"), prompts, 12)}
    for folder in folders:
        expected[folder] = hf_greedy(f"{folder}-merged", prompts, 12)
    assert expected[folders[0]] != expected[None] and expected[folders[1]] != expected[None]
    assert [o.token_ids for o in outs] == [expected[f][i] for i, f in enumerate(which)]


@pytest.mark.slow
def test_smollm2_cpu_int8_with_an_adapter_is_as_close_as_the_quantized_merged_model(smollm2_adapters, capsys):
    folders, prompts = smollm2_adapters
    folder = folders[1]  # every target, rank 16
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=1, top_logprobs=5)

    def top(llm, request=None):
        outs = llm.generate(prompts, params, lora_request=[request] * len(prompts))
        return torch.tensor([[lp for _, lp in o.top_logprobs[0]] for o in outs])

    reference = top(LLM(f"{folder}-merged", device="cpu", dtype="float32"))
    quantized_merged = (top(one_kernel_for_every_row_count(LLM(f"{folder}-merged", runtime="cpu-int8", device="cpu",
                                                               skip_quality_gate=True))) - reference).abs().mean()
    int8 = one_kernel_for_every_row_count(LLM("smollm2-135m", runtime="cpu-int8", device="cpu", max_loras=1,
                                              max_lora_rank=16))
    ours = (top(int8, LoraRequest("smol1", folder)) - reference).abs().mean()
    without = (top(int8) - reference).abs().mean()
    with capsys.disabled():
        print(f"\nSmolLM2 + rank-16 adapter, mean |top-5 logprob - float merged|: cpu-int8 with the adapter "
              f"{ours:.4f}, the merged model quantized {quantized_merged:.4f}, cpu-int8 without it {without:.4f}")
    assert ours <= max(2 * quantized_merged, 0.05), (ours, quantized_merged)
    assert ours < without / 2, (ours, without)


def llm_reference(alias: str):
    """transformers' SmolLM2 from the same GGUF file (the base's oracle)."""
    from transformers import AutoModelForCausalLM

    from inferplane.api.model_resolution import builtin_model_path

    gguf = builtin_model_path(alias)
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)


def test_the_choices_of_one_request_share_its_adapter(lora_setup):
    """n > 1: the forked choices run under the leader's adapter (its slot pinned for each)."""
    base, adapters, prompts, expected = lora_setup
    llm = LLM(base, runtime="radix", device="cpu", dtype="float32", max_loras=1, max_lora_rank=16)
    outs = llm.generate(prompts[3:4], SamplingParams(n=3, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=LoraRequest("adapter1", adapters[1]))
    assert [o.token_ids for o in outs] == [expected[adapters[1]][3]] * 3
    stats = llm.stats()
    assert stats["forked_sequences"] == 2 and stats["lora_slots_pinned"] == 0
