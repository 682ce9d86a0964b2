"""int8 weights for the cpu-int8 runtime: the layer (int8_linear), conversion and the start-up gate
(convert), the evaluation (gate) and `inferplane quant-check` (cli). Nothing is imported here so
that the CLI's argument parsing stays free of torch."""
