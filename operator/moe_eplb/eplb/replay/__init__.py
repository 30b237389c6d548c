"""The replay of vLLM's EPLB: ``policy`` (the rebalance policy), ``kernels`` (compiled inner loops),
``simulator`` (``Replay`` over a trace), ``costmodel`` (predicted throughput), ``capacity`` (what
redundancy costs in KV cache and replicas). Imports ``workload``, never ``tuning``."""
