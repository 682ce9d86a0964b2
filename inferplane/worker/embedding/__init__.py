"""The embedding runtime: an encoder model (BERT family), its sentence-transformers pooling, and
one thread that batches every request's inputs into padded forwards.

- pooling.py: what a model folder's modules.json and 1_Pooling/config.json say to do with the
  last hidden states (mean, cls, max; then Normalize when listed).
- encoder.py: the folder loaded (weights, tokenizer, pooling) and `embed(inputs)`: one padded
  forward over token-id lists.
- batcher.py: the queue the gRPC handlers put inputs into and one thread drains, batching
  concurrent requests together, so no forward ever runs on the event loop.
"""
