"""A GGUF file's Mixture-of-Experts layers keep every expert in one tensor [experts, rows, columns]
(blk.N.ffn_gate_exps and its kin). cpu-int8 serves each expert from its own slice of the file's
blocks, as it serves a dense layer's (quant/gguf_blocks.py): a Q4_K_M MoE file stays 4-bit instead
of becoming int8 at twice the bytes."""

from __future__ import annotations

import numpy as np
import torch

from tests.worker.test_quant import needs_native_int8

# Gate and up share a type (they fuse into one layer of it); down has another, as in Q4_K_M files.
TYPES = {"gate": "Q4_1", "up": "Q4_1", "down": "Q5_0"}


def _write_experts(path, model) -> dict[str, np.ndarray]:
    """The model's experts as a GGUF file's stacked tensors, quantized by gguf-py; returns what
    gguf-py dequantizes each stacked tensor to, by its GGUF name."""
    import gguf
    from gguf import quants

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    expected = {}
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for proj, type_name in TYPES.items():
            stacked = torch.stack([getattr(e, f"{proj}_proj").weight.detach() for e in experts]).numpy()
            qtype = gguf.GGMLQuantizationType[type_name]
            raw = quants.quantize(stacked, qtype)
            name = f"blk.{index}.ffn_{proj}_exps.weight"
            writer.add_tensor(name, raw, raw_dtype=qtype)
            expected[name] = quants.dequantize(raw, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@needs_native_int8
def test_stacked_experts_are_served_from_their_own_blocks(tmp_path):
    from inferplane.worker.model.gguf_file import load_gguf_tensors, open_gguf
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant.block_linear import BlockLinear
    from inferplane.worker.quant.convert import convert_model
    from inferplane.worker.quant.gate import sequence_logits
    from tests.worker.conftest import prompts_of_lengths
    from tests.worker.test_architectures import VOCAB, save_family

    # 16 experts 64 wide: every stacked tensor's rows a whole number of blocks of 32
    path = save_family(tmp_path / "hf", "qwen3_moe", seed=3, num_experts=16, moe_intermediate_size=64)
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    model = loaded.model
    expected = _write_experts(tmp_path / "experts.gguf", model)
    floats = dict(load_gguf_tensors(open_gguf(str(tmp_path / "experts.gguf")), model.config))
    assert len(floats) == 2 * 3 * 16  # the float loader splits the same tensors per expert
    assert np.array_equal(floats["model.layers.2.mlp.experts.5.down_proj.weight"].numpy(),
                          expected["blk.2.ffn_down_exps.weight"][5])
    ids = prompts_of_lengths([30], VOCAB, seed=2)[0]
    before = sequence_logits(model, ids)

    report = convert_model(model, gguf_path=str(tmp_path / "experts.gguf"), q4_blocks=True, measure_dispatch=False)

    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == [0, 2]  # layer 1 is dense (mlp_only_layers): its MLP is int8, not from the file
    for index in moe_layers:
        for e, expert in enumerate(model.model.layers[index].mlp.experts):
            assert isinstance(expert.gate_up_proj, BlockLinear) and expert.gate_up_proj.bits == 4
            assert isinstance(expert.down_proj, BlockLinear) and expert.down_proj.bits == 5
            gate, up, down = (torch.from_numpy(expected[f"blk.{index}.ffn_{p}_exps.weight"][e]) for p in TYPES)
            torch.testing.assert_close(expert.gate_up_proj.dequantized_weight(), torch.cat([gate, up]),
                                       rtol=0, atol=0)
            torch.testing.assert_close(expert.down_proj.dequantized_weight(), down, rtol=0, atol=0)
    assert report.from_file_blocks == {"q4_1": 2 * 2 * 16, "q5_1": 2 * 16}
    after = sequence_logits(model, ids)  # 4- and 5-bit experts on random weights: routing moves a little
    assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0).item() >= 0.95
