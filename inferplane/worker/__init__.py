"""One process = one model replica. Three wings, each importing only the ones below it:

- `serve/`: how a replica is served (gRPC server, the engine's asyncio face, metrics, the
  `inferplane worker` command, the memory check before loading).
- `engine/`: what runs each step (the loop, scheduling, fair share, the model runner, sampling,
  decode graphs, runtimes) and `engine/kv/`, which KV blocks each sequence owns.
- `ops/`: the ground floor, one module per op (norm, rope with the KV write, activation, attention,
  output head, the KV tensor store), each choosing C (`ops/native/`), Triton or torch once.

Between the engine and the ops stand the model side: `model/` (plain PyTorch that calls ops: a
new model family touches only it), `quant/` (GGUF blocks and int8 for cpu-int8), `lora/` (adapter
slots), `embedding/` (the encoder runtime) and `structured/` (grammars for structured outputs).
`llm.py` is the offline Python entry point (`from inferplane import LLM`). `tests/test_layers.py`
holds the order.
"""
