"""Child process of the launch-logic tier: one vLLM release's own launch logic, driven by JSON lines.

Run as ``python tests/launch_logic/vllm_launcher.py`` with ``import vllm`` resolving to the release
(the installed CPU wheel, or a release's Python sources first on ``PYTHONPATH``). It imports the
release once, then answers one JSON line per request line on stdin:

``{"argv": [...], "env": {...}}``
    ``argv`` is what a pod's ``vllm`` executable received (``serve`` first), ``env`` the pod's
    environment. The release's own code decides, in order: its ``vllm serve`` parser
    (``make_arg_parser``), ``validate_parsed_serve_args``, the serve path ``ServeSubcommand.cmd``
    picks (with the launchers -- ``run_server``, ``run_multi_api_server``, ``run_headless``,
    ``run_dp_supervisor`` -- replaced by recorders; nothing is started), and
    ``EngineArgs.create_engine_config`` of every engine front end that path builds (the multi-port
    supervisor's children from its own ``_build_vllm_dp_server_args``) up to the real
    ``ParallelConfig`` it constructs, with the model config stubbed (an MoE model; no weights, no hub)
    and ``maybe_override_with_speculators`` left out (it reads the model's config from the hub).
    Answer: the path, the API server count, and per front end the load-balancing mode, its port,
    the ranks it dispatches to (``v1/engine/core_client.py``: ``range(rank, rank + (local size if
    local_engines_only else size))``) and the ranks whose engines it starts; or ``{"error": ...}``
    with vLLM's own message.
``{"choices": true}``
    what the release's parser and config offer: the ``--all2all-backend`` choices, the
    ``EPLBConfig`` keys, the ``communicator`` choices and the supervisor port's default.

Stand-ins, all labelled: the model config (see above); and where a release's API-server module
cannot be imported here (0.33 and 0.34 need ``orjson``, not installed) a module holding the two
names ``entrypoints/cli/serve.py`` imports from it (``run_server``, ``setup_server``), which are
launchers the tier stubs anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import traceback
import types
import typing

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_PLUGINS"] = "none"  # no general plugins (ours included) in the parser's process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ENTRY = "vllm.entrypoints.launchers.api_server.entry"


class MoeModelStandIn:
    """Stand-in for the ``ModelConfig`` ``create_model_config`` builds (it reads the model's config from
    the hub or a directory): an MoE text-generation model, what ``create_engine_config`` reads of it
    before the ``ParallelConfig``."""

    is_moe = True
    skip_tokenizer_init = False
    is_attention_free = False
    is_chunked_prefill_supported = True
    is_prefix_caching_supported = True
    runner_type = "generate"
    hf_config = None
    model_weights = ""
    dtype = "bfloat16"

    def __init__(self, model: str, tokenizer: str | None) -> None:
        self.model, self.tokenizer = model, tokenizer or model
        self.hf_text_config = types.SimpleNamespace()

    def get_sliding_window(self):
        return None


class Reached(Exception):
    """``ParallelConfig`` was built: stop ``create_engine_config`` there."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__("ParallelConfig reached")
        self.kwargs = kwargs


class StopAtParallelConfig:
    """In place of ``ParallelConfig`` in ``engine/arg_utils.py``: stops ``create_engine_config`` with
    the keyword arguments it was about to build the config from (building it would run the CPU
    platform's checks, which refuse EPLB on CPU: not what a GPU pod sees). Class attributes (defaults
    the function reads) are the real class's."""

    def __init__(self, real: type) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def __call__(self, **kwargs):
        raise Reached(kwargs)


def _import_serve():
    """``vllm.entrypoints.cli.serve``, with the API-server entry module stood in where it cannot be
    imported here (see the module doc). Returns (module, stood_in)."""
    try:
        import vllm.entrypoints.cli.serve as serve
        return serve, False
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("vllm"):
            raise
        for name in [m for m in sys.modules if m.startswith("vllm.entrypoints.cli.serve")]:
            del sys.modules[name]
        stub = types.ModuleType(ENTRY)
        stub.__doc__ = f"stand-in: {ENTRY} needs {exc.name}, not installed; run_server/setup_server are stubbed"

        def run_server(args, **_kw):  # never run: ServeSubcommand.cmd's launcher is stubbed
            raise AssertionError("stubbed launcher")

        stub.run_server = run_server
        stub.setup_server = run_server
        sys.modules[ENTRY] = stub
        import vllm.entrypoints.cli.serve as serve
        return serve, True


def _parser_api():
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # vLLM <= 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()), validate_parsed_serve_args


class Release:
    """The imported release, its parser and its launch functions (stubbed where they would start
    something)."""

    def __init__(self) -> None:
        import vllm
        import vllm.engine.arg_utils as arg_utils
        import vllm.entrypoints.launchers.dp_supervisor as dp_supervisor

        self.version = vllm.__version__
        self.serve, self.stood_in = _import_serve()
        self.parser, self.validate = _parser_api()
        self.arg_utils, self.dp_supervisor = arg_utils, dp_supervisor
        self.real_parallel_config = arg_utils.ParallelConfig
        self.path: list[tuple[str, object]] = []

        def record(name):
            def launcher(args, *rest, **kw):
                self.path.append((name, args))
            return launcher

        self.serve.run_dp_supervisor = record("dp_supervisor")
        self.serve.run_headless = record("headless")
        self.serve.run_multi_api_server = record("multi_api_server")
        self.serve.run_server = record("api_server")
        self.serve.uvloop = types.SimpleNamespace(run=lambda _coro: None)

    # --- one pod ---------------------------------------------------------------------------------

    def choices(self) -> dict:
        from vllm.config.parallel import EPLBConfig

        all2all = next(a.choices for a in self.parser._actions if a.dest == "all2all_backend")
        fields = {f.name: f for f in dataclasses.fields(EPLBConfig)}
        comm = [a for a in typing.get_args(typing.get_type_hints(EPLBConfig)["communicator"]) if a is not type(None)]
        comm = [c for arg in comm for c in (typing.get_args(arg) or (arg,))]
        supervisor = next(a.default for a in self.parser._actions if a.dest == "data_parallel_supervisor_port")
        return {"version": self.version, "all2all_backends": sorted(all2all), "eplb_config_keys": sorted(fields),
                "communicators": sorted(comm), "supervisor_port": supervisor, "api_entry_stood_in": self.stood_in}

    def _parallel(self, args, headless: bool) -> dict:
        """``create_engine_config`` of ``args`` up to the ParallelConfig it builds (its kwargs)."""
        arg_utils = self.arg_utils

        model = MoeModelStandIn(args.model, getattr(args, "tokenizer", None))
        engine = arg_utils.EngineArgs.from_cli_args(args)
        with _patched(arg_utils, "ParallelConfig", StopAtParallelConfig(self.real_parallel_config)), \
                _patched(arg_utils, "maybe_override_with_speculators",
                         lambda model, tokenizer, vllm_speculative_config=None, **_: (model, tokenizer,
                                                                                     vllm_speculative_config)), \
                _patched(arg_utils.EngineArgs, "create_model_config", lambda _self: model):
            try:
                engine.create_engine_config(headless=headless)
            except Reached as reached:
                return reached.kwargs
        raise AssertionError("create_engine_config returned without building a ParallelConfig")

    def _front_end(self, args, headless: bool, processes: int | None) -> dict:
        kw = self._parallel(args, headless)
        size, rank, local = kw["data_parallel_size"], kw["data_parallel_rank"], kw["data_parallel_size_local"]
        external, hybrid = bool(kw["data_parallel_external_lb"]), bool(kw.get("data_parallel_hybrid_lb"))
        lb = "external" if external else "hybrid" if hybrid else "internal"
        managed = local if (external or hybrid) else size
        out = {"lb": lb, "rank": rank, "size": size, "local": local, "engines": list(range(rank, rank + local))}
        if not headless:
            out.update(port=args.port, ranks=list(range(rank, rank + managed)), processes=processes)
        out["fault_tolerance"] = bool(kw.get("enable_fault_tolerance"))
        out["elastic"] = bool(kw.get("enable_elastic_ep"))
        out["elastic_max"] = kw.get("elastic_ep_max_dp_size")
        return out

    def launch(self, argv: list[str], env: dict[str, str]) -> dict:
        if not argv or argv[0] != "serve":
            return {"error": f"not a vllm serve command: {argv[:2]}"}
        with _environ(env):
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    args = self.parser.parse_args(argv[1:])
            except SystemExit:  # argparse's way of refusing: its message is the answer
                return {"error": "vLLM's parser: " + (err.getvalue().strip().splitlines() or ["exited"])[-1]}
            self.validate(args)
            self.path.clear()
            self.serve.ServeSubcommand.cmd(args)
            if len(self.path) != 1:
                return {"error": f"ServeSubcommand.cmd ran {len(self.path)} launchers"}
            path, args = self.path[0]
            out: dict = {"path": path, "api_server_count": args.api_server_count, "front_ends": []}
            if path == "dp_supervisor":
                for i in range(args.data_parallel_size_local):
                    child = self.dp_supervisor._build_vllm_dp_server_args(args, i)
                    out["front_ends"].append(self._front_end(child, False, child.api_server_count))
                out["supervisor_port"] = args.data_parallel_supervisor_port
            elif path == "headless":
                out["front_ends"].append(self._front_end(args, True, None))
            else:
                count = args.api_server_count or 1
                out["front_ends"].append(self._front_end(args, False, count))
            return out


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """The pod's environment for the call (its ``VLLM_*`` variables are what vLLM validates), without
    the plugin list and Python path (the tier loads no plugin)."""
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH", "PATH")})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    # the answers go to the original stdout; vLLM's own logging (which writes to stdout) to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    release = Release()
    print(json.dumps({"ready": release.version}), file=answers, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            answer = release.choices() if req.get("choices") else release.launch(req["argv"], req.get("env") or {})
        except SystemExit as exc:
            answer = {"error": f"vLLM exited ({exc.code})"}
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal, reported with its words
            answer = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc(limit=-3)}
        print(json.dumps(answer), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
