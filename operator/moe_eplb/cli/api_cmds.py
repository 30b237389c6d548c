"""``moe-eplb validate``, ``moe-eplb render`` and ``moe-eplb crd``."""

from __future__ import annotations

import sys
from typing import Any

import click
import yaml


def _load_documents(path: str) -> list[Any]:
    from moe_eplb.api.manifest import ManifestError, load_documents

    try:
        return load_documents(path)
    except ManifestError as exc:
        raise click.ClickException(str(exc)) from None


MAX_PRINTED = 50  # problems printed per document


class _PlainDumper(yaml.SafeDumper):
    """Plain YAML for people and kubectl: a value used twice is written twice (no &id001 anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _label(doc: Any, index: int) -> str:
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None
    return f"document {index + 1}" + (f" ({name})" if name else "")


def _is_ours(doc: Any) -> bool:
    """Documents of the eplb.ai API group are checked; others (a Secret next to it) are skipped."""
    from moe_eplb.contracts.k8s_names import API_GROUP

    if not isinstance(doc, dict):
        return True
    return str(doc.get("apiVersion", "")).split("/")[0] in (API_GROUP, "")


def _check_all(path: str) -> tuple[list[Any], bool]:
    """Validate and parse every eplb.ai document (once each); print problems on stderr, and notes
    on recorded tuner overrides that do not run. Returns (parsed MoEInferences, all_valid).

    Documents of other API groups are skipped (with a note on stderr).
    """
    from moe_eplb.api.validation import check, override_problems

    docs = []
    for i, doc in enumerate(_load_documents(path)):
        if _is_ours(doc):
            docs.append(doc)
        else:
            click.echo(f"{path}: {_label(doc, i)}: {doc.get('kind')} ({doc.get('apiVersion')}) is not a "
                       "MoEInference, skipped", err=True)
    if not docs:
        click.echo(f"{path}: no MoEInference documents found", err=True)
        return docs, False
    ok = True
    parsed = []
    for i, doc in enumerate(docs):
        checked = check(doc)
        prefix = f"{path}: {_label(doc, i)}" if len(docs) > 1 else path
        for problem in checked.problems[:MAX_PRINTED]:
            click.echo(f"{prefix}: {problem.field}: {problem.message}", err=True)
        if len(checked.problems) > MAX_PRINTED:
            click.echo(f"{prefix}: ... and {len(checked.problems) - MAX_PRINTED} more problems", err=True)
        if checked.problems or checked.inference is None:
            ok = False
            continue
        for note in override_problems(checked.inference):
            click.echo(f"{prefix}: note: {note.field}: {note.message}", err=True)
        parsed.append(checked.inference)
    return parsed, ok


def register(main: click.Group) -> None:
    @main.command("validate")
    @click.option("-f", "--filename", "path", required=True, help="MoEInference YAML file ('-' = stdin); multi-document allowed.")
    def validate_cmd(path: str) -> None:
        """Check MoEInference resources like the CRD and the operator do.

        Exit status 0 and 'valid' when every document is valid; 1 and the problems on stderr otherwise.
        """
        _, ok = _check_all(path)
        if not ok:
            sys.exit(1)
        click.echo("valid")

    @main.command("render")
    @click.option("-f", "--filename", "path", required=True, help="MoEInference YAML file ('-' = stdin); multi-document allowed.")
    def render_cmd(path: str) -> None:
        """Print the child objects the operator would apply, as a YAML stream."""
        from moe_eplb.render.objects import render_children

        resources, ok = _check_all(path)
        if not ok:
            sys.exit(1)
        children = [child for inf in resources for child in render_children(inf)]
        click.echo(yaml.dump_all(children, Dumper=_PlainDumper, sort_keys=False), nl=False)

    @main.command("crd")
    def crd_cmd() -> None:
        """Print the MoEInference CustomResourceDefinition (kubectl apply -f -)."""
        from moe_eplb.api.crd import crd_text

        click.echo(crd_text(), nl=False)
