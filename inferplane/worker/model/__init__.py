"""Model code of our own (Llama family), so the KV cache, attention and quantization are ours."""
