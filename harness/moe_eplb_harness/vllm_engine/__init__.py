"""Running the REAL vLLM engine on CPU with the test bridge ("vLLM on CPU with the test bridge").

The rig (:mod:`.harness`: the rendered container's args with the CPU adaptations, the tiny
Qwen3-MoE of :mod:`.tiny_model`, the CPU EPLB bridge of :mod:`.cpu_eplb_bridge` made a vLLM plugin
by :mod:`.plugin_dist`; :mod:`.vllm_cli`, vLLM's CLI under the CPU wheel's distribution name), the
exporter overhead measurement (:mod:`.overhead`) and the two one-command runs (:mod:`.e2e`,
:mod:`.closed_loop`). Used by the real-engine tests (``tests/vllm_engine``),
``scripts/e2e_vllm_cpu.sh``, ``scripts/demo_vllm_cpu.sh`` and ``bench/bench_exporter_real.py``;
part of the harness distribution, never of the product or its images.
"""
