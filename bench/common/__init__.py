"""What every bench shares: `harness` (interleaved rounds, medians), `machine` (the machine's
description), `report` (JSON + markdown + PNG results), `server` (start `bitdelta serve` or
llama-server and wait for /health), `load` (streamed requests), `peers` (llama.cpp and
transformers), `checkouts` (this checkout beside an earlier commit), `random_models` (random-weight
Llamas and random 1-bit variants) and `paths`."""
