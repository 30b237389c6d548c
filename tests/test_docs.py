"""The README and docs/ stay what a newcomer can use: the README short with its two commands, every
link into the repository resolving (to a file, and to a heading where it names one), no working
notes ("this stop", "this session", the project's issue numbers), and every package docstring
naming each module the package holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import source_ast

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PACKAGE = ROOT / "operator" / "moe_eplb"
HARNESS = ROOT / "harness" / "moe_eplb_harness"
MAX_README_LINES = 150

#: wording of working notes, never of documentation. Upstream numbers stay fine when they say whose
#: they are ("vLLM PR #28849", "vLLM issue #32388", "PR #22842").
NOTES = [
    (re.compile(r"\bthis (?:stop|session)\b", re.I), "'this stop' / 'this session'"),
    (re.compile(r"\bstops? \d+\b", re.I), "a stop number"),
    (re.compile(r"(?<!vLLM )\bissues? #?\d+\b", re.I), "an issue number"),
    (re.compile(r"(?<!PR )(?<!issue )#\d+\b"), "a bare #number"),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (lower case, punctuation dropped, spaces -> '-')."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    """The Markdown of ``path`` without code (fenced blocks and inline spans)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings in code blocks
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_readme_is_short_and_keeps_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text


def test_the_two_commands_set_up_a_fresh_clone_first():
    """``make demo`` and ``make test`` make the virtualenv (and what the tests need) themselves."""
    makefile = (ROOT / "Makefile").read_text()
    deps = {k: v.split("##")[0] for k, v in re.findall(r"^(demo|test|test-slow|kube):(.*)$", makefile, flags=re.M)}
    assert set(deps["demo"].split()) >= {"setup"}
    assert set(deps["test"].split()) >= {"setup", "setup-vllm", "kube-main"}
    # the slow tier needs the tools only it uses (KEDA, Helm, the Prometheus Operator) besides the main ones
    assert set(deps["test-slow"].split()) >= {"setup", "setup-vllm", "kube"}
    assert set(deps["kube"].split()) == {"kube-main", "kube-slow"}


def test_make_help_lists_every_target_with_one_line():
    """``make help`` (the default goal) prints every target of the Makefile with its ``## `` line."""
    makefile = (ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*)$", makefile, flags=re.M).group(1).split())
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):(?!=)", makefile, flags=re.M))
    described = dict(re.findall(r"^([a-z][a-z0-9-]*):[^=#\n]*## (.+)$", makefile, flags=re.M))
    assert targets == phony, f"not .PHONY: {sorted(targets - phony)}; no such target: {sorted(phony - targets)}"
    assert set(described) == targets, f"targets without a '## what it does' line: {sorted(targets - set(described))}"
    assert re.search(r"^\.DEFAULT_GOAL := help$", makefile, flags=re.M) and "help" in described


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_working_notes(path):
    found = [f"{path.name}:{n}: {what}: {line.strip()[:100]}" for n, line in enumerate(path.read_text().splitlines(), 1)
             for pattern, what in NOTES if pattern.search(line)]
    assert not found, "\n".join(found)


#: the product's and the harness's code and build files: what they do, not which issue asked for it
CODE = [*sorted(PACKAGE.rglob("*.py")), *sorted(HARNESS.rglob("*.py")), ROOT / "pyproject.toml",
        ROOT / "harness" / "pyproject.toml", ROOT / "Makefile", ROOT / "Dockerfile"]


def test_no_issue_numbers_in_the_code():
    issue = NOTES[2][0]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for path in CODE
             for n, line in enumerate(path.read_text().splitlines(), 1) if issue.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_links_into_the_repository_resolve(path):
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


PACKAGES = sorted(p.parent for p in PACKAGE.rglob("*/__init__.py"))
HARNESS_PACKAGES = sorted(p.parent for p in HARNESS.rglob("*/__init__.py"))


def _dotted(package) -> str:
    top = HARNESS if package == HARNESS or HARNESS in package.parents else PACKAGE
    return ".".join(package.relative_to(top.parent).parts)


@pytest.mark.parametrize("package", [*PACKAGES, HARNESS, *HARNESS_PACKAGES], ids=_dotted)
def test_package_docstring_names_every_module(package):
    doc = ast.get_docstring(source_ast.parse((package / "__init__.py").read_text())) or ""
    missing = [m.stem for m in sorted(package.glob("*.py"))
               if m.stem != "__init__" and not re.search(rf"\b{re.escape(m.stem)}\b", doc)]
    assert not missing, f"{_dotted(package)}'s docstring does not say what it holds: {', '.join(missing)}"


_TREE_LINE = re.compile(r"^((?:│   |    )*)(?:├── |└── )([\w.]+)/")


def folders_in_the_picture(text: str, root: str = "operator/moe_eplb/") -> set[str]:
    """The folders of the ``root`` tree picture in ``text`` (paths under it)."""
    block = text.split(f"```\n{root}\n", 1)[1].split("```", 1)[0]
    out, stack = set(), []
    for line in block.splitlines():
        m = _TREE_LINE.match(line)
        if m:
            depth = len(m.group(1)) // 4
            stack = stack[:depth] + [m.group(2)]
            out.add("/".join(stack))
    return out


@pytest.mark.parametrize("root,packages", [(PACKAGE, PACKAGES), (HARNESS, HARNESS_PACKAGES)],
                         ids=["product", "harness"])
def test_the_architecture_picture_matches_the_package_folders(root, packages):
    name = f"{root.relative_to(ROOT).as_posix()}/"
    pictured = folders_in_the_picture((ROOT / "docs" / "architecture.md").read_text(), name)
    folders = {"/".join(p.relative_to(root).parts) for p in packages}
    assert pictured == folders, (f"docs/architecture.md's {name} tree: not folders {sorted(pictured - folders)}; "
                                 f"missing {sorted(folders - pictured)}")


def test_the_picture_reader_reads_nesting():
    text = "x\n```\noperator/moe_eplb/\n├── api/   a\n└── sim/   s\n    ├── emulated/  e\n    └── real/\n```\n"
    assert folders_in_the_picture(text) == {"api", "sim", "sim/emulated", "sim/real"}
