"""Regenerate the per-release choices in ``operator/moe_eplb/api/vllm_cli.py`` from each vLLM
release's own code: the ``--all2all-backend`` choices of its ``vllm serve`` parser, the
``EPLBConfig`` keys and ``communicator`` choices, the multi-port supervisor's default port.

Each release in range (the installed CPU wheel; the Python sources of requirements/vllm-src.txt under
``<venv>/vllm-src/<X>``) is asked through the launch-logic tier's child
(``tests/launch_logic/vllm_launcher.py``, one process per release, imported once). The launch-logic
tier fails while the committed block differs from what a release says.

Usage: ``.venv/bin/python scripts/vllm_cli_choices.py`` (rewrites the block; ``--print`` writes it to
stdout instead).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "operator" / "moe_eplb" / "api" / "vllm_cli.py"
LAUNCHER = REPO / "tests" / "launch_logic" / "vllm_launcher.py"
BEGIN, END = "# BEGIN generated (scripts/vllm_cli_choices.py)", "# END generated"
KINDS = ("all2all_backends", "eplb_config_keys", "communicators")


def source_versions() -> list[str]:
    """Every ``vllm==X`` of requirements/vllm-src.txt (the releases held by their sources)."""
    text = (REPO / "requirements" / "vllm-src.txt").read_text()
    return re.findall(r"^\s*vllm==([0-9][0-9A-Za-z.+-]*)\s*$", text, re.M)


def ask(root: Path | None) -> dict:
    """The choices of the release whose ``vllm`` is at ``root`` (None: the installed wheel)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    paths = ([str(root)] if root else []) + [str(REPO / "operator"), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(LAUNCHER)], input=json.dumps({"choices": True}) + "\n",
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or len(lines) != 2:
        raise SystemExit(f"the launcher for {root or 'the installed wheel'} failed: {out.stderr[-2000:]}")
    return lines[1]


def _name(kind: str, version: tuple[int, ...]) -> str:
    return f"_{kind.upper()}_{'_'.join(map(str, version))}"


def block(answers: list[dict]) -> str:
    """The generated block's text (between the markers): each distinct set of choices once, as a tuple
    named after the first release that offers it, and per release the sets it offers (releases that
    offer the same set share its tuple)."""
    def version_of(a: dict) -> tuple[int, ...]:
        return tuple(int(p) for p in a["version"].split("+")[0].split(".")[:3])

    answers = sorted(answers, key=version_of)
    lines: list[str] = []
    names: dict[tuple[str, tuple[str, ...]], str] = {}
    for kind in KINDS:
        for a in answers:
            values = tuple(sorted(a[kind]))
            if (kind, values) in names:
                continue
            names[(kind, values)] = _name(kind, version_of(a))
            lines.append(f"{names[(kind, values)]} = (")
            lines += textwrap.wrap(" ".join(f'"{v}",' for v in values), 100, initial_indent=" " * 4,
                                   subsequent_indent=" " * 4, break_on_hyphens=False, break_long_words=False)
            lines.append(")")
    lines += ["", "RELEASES: dict[Version, dict[str, tuple[str, ...] | int]] = {"]
    for a in answers:
        head = f"    {version_of(a)}: {{"
        sets = [f'"{kind}": {names[(kind, tuple(sorted(a[kind])))]},' for kind in KINDS]
        sets.append(f'"supervisor_port": {int(a["supervisor_port"])}}},')
        lines += textwrap.wrap(" ".join(sets), 110, initial_indent=head, subsequent_indent=" " * len(head),
                               break_on_hyphens=False, break_long_words=False)
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="write the block to stdout")
    opts = parser.parse_args()
    answers = [ask(None)]
    for version in source_versions():
        root = Path(sys.prefix) / "vllm-src" / version
        if not (root / "vllm").is_dir():
            raise SystemExit(f"vLLM {version}'s sources are not at {root}: run `make setup-vllm`")
        answers.append(ask(root))
    text = block(answers)
    if opts.print:
        sys.stdout.write(text)
        return 0
    source = TARGET.read_text()
    head, rest = source.split(BEGIN + "\n", 1)
    _, tail = rest.split(END, 1)
    TARGET.write_text(head + BEGIN + "\n" + text + END + tail)
    print(f"{TARGET.relative_to(REPO)}: {len(answers)} releases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
