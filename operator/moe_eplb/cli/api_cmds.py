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


def _short(value: Any, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _label(doc: Any, index: int) -> str:
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"document {index + 1}" + (f" ({_short(name)})" if name else "")


def _is_ours(doc: Any) -> bool:
    """Documents of the eplb.ai API group are checked; others (a Secret next to it) are skipped."""
    from moe_eplb.contracts.k8s_names import API_GROUP

    if not isinstance(doc, dict):
        return True
    return str(doc.get("apiVersion", "")).split("/")[0] in (API_GROUP, "")


def operator_defaults(prometheus_url: str | None, exporter_image: str | None,
                      pod_monitor_labels: str | None) -> Any:
    """The operator's defaults from ``validate``'s and ``render``'s options, checked as ``moe-eplb run``
    checks its own (a bad value: a usage error naming the option)."""
    from moe_eplb.controller import settings as s

    try:
        return s.build(prometheus_url=prometheus_url, exporter_image=exporter_image,
                       pod_monitor_labels=pod_monitor_labels, draw_priority=lambda: 1).defaults
    except s.SettingsError as exc:
        raise click.UsageError(f"{exc.option}: {str(exc).split(': ', 1)[1]}") from None


def _operator_options(command: Any) -> Any:
    """``--prometheus-url``, ``--exporter-image``, ``--pod-monitor-labels``: ``moe-eplb run``'s defaults
    for what a resource leaves unset, so that ``validate`` and ``render`` check and render as that
    operator does."""
    for option in reversed((
        click.option("--prometheus-url", metavar="URL", default=None,
                     help="The operator's --prometheus-url: the Prometheus of resources without "
                          "spec.monitoring.prometheusUrl (KEDA autoscaling needs one)."),
        click.option("--exporter-image", metavar="IMAGE", default=None,
                     help="The operator's --exporter-image: the exporter-injection init container's image for "
                          "resources without spec.engine.exporter.image (default: the operator image of this "
                          "version)."),
        click.option("--pod-monitor-labels", metavar="LABELS", default=None,
                     help="The operator's --pod-monitor-labels (key=value,key=value or a JSON object): labels "
                          "every rendered PodMonitor carries; the resource's own win."),
    )):
        command = option(command)
    return command


def _check_all(path: str, defaults: Any) -> tuple[list[dict[str, Any]], bool]:
    """Validate, parse (once each) and render every eplb.ai document as the operator with ``defaults``
    does; print problems on stderr, and notes on recorded tuner overrides that do not run. Returns
    (the children of the valid documents, all_valid): ``validate`` and ``render`` refuse the same
    documents in the same words, a document that cannot be rendered included.

    Documents of other API groups are skipped (with a note on stderr).
    """
    from moe_eplb.api.advice import advice
    from moe_eplb.api.problem import Problem
    from moe_eplb.api.validation import check_for_operator, override_problems
    from moe_eplb.render.objects import render_children

    docs = []  # (index in the file, document): a document is named by its place in the file
    for i, doc in enumerate(_load_documents(path)):
        if _is_ours(doc):
            docs.append((i, doc))
        else:
            click.echo(f"{path}: {_label(doc, i)}: {_short(doc.get('kind'))} ({_short(doc.get('apiVersion'))}) is not "
                       "a MoEInference, skipped", err=True)
    if not docs:
        click.echo(f"{path}: no MoEInference documents found", err=True)
        return [], False
    ok = True
    children: list[dict[str, Any]] = []
    several = len(docs) > 1
    for i, doc in docs:
        checked = check_for_operator(doc, defaults)
        problems, rendered = list(checked.problems), []
        if not problems and checked.inference is not None:
            try:
                rendered = render_children(checked.inference)
            except Exception as exc:  # noqa: BLE001 - a case validation missed: one line, as the operator says it
                problems = [Problem("spec", f"cannot render the children: {exc}")]
        prefix = f"{path}: {_label(doc, i)}" if several else path
        for problem in problems[:MAX_PRINTED]:
            click.echo(f"{prefix}: {problem.field}: {problem.message}", err=True)
        if len(problems) > MAX_PRINTED:
            click.echo(f"{prefix}: ... and {len(problems) - MAX_PRINTED} more problems", err=True)
        if problems or checked.inference is None:
            ok = False
            continue
        for note in override_problems(checked.inference):
            click.echo(f"{prefix}: note: {note.field}: {note.message}", err=True)
        for warning in advice(checked.inference):  # what a valid resource may cost: never a refusal
            click.echo(f"{prefix}: warning: {warning.field}: {warning.message}", err=True)
        children += rendered
    return children, ok


def register(main: click.Group) -> None:
    @main.command("validate")
    @click.option("-f", "--filename", "path", required=True, help="MoEInference YAML file ('-' = stdin); multi-document allowed.")
    @_operator_options
    def validate_cmd(path: str, **operator: Any) -> None:
        """Check MoEInference resources like the CRD and the operator do.

        Exit status 0 and 'valid' when every document is valid; 1 and the problems on stderr otherwise.
        Warnings (e.g. EPLB on an all2all backend that drops the shared-expert overlap) go to stderr as
        'warning:' lines and never change the exit status.
        A valid resource is one the operator renders: give the operator's --prometheus-url where a
        resource relies on it (KEDA autoscaling without spec.monitoring.prometheusUrl).
        """
        _, ok = _check_all(path, operator_defaults(**operator))
        if not ok:
            sys.exit(1)
        click.echo("valid")

    @main.command("render")
    @click.option("-f", "--filename", "path", required=True, help="MoEInference YAML file ('-' = stdin); multi-document allowed.")
    @_operator_options
    def render_cmd(path: str, **operator: Any) -> None:
        """Print the child objects the operator would apply, as a YAML stream.

        Refuses (exit status 1, the problems on stderr) exactly what validate refuses, in the same words.
        """
        children, ok = _check_all(path, operator_defaults(**operator))
        if not ok:
            sys.exit(1)
        click.echo(yaml.dump_all(children, Dumper=_PlainDumper, sort_keys=False), nl=False)

    @main.command("crd")
    def crd_cmd() -> None:
        """Print the MoEInference CustomResourceDefinition (kubectl apply -f -)."""
        from moe_eplb.api.crd import crd_text

        click.echo(crd_text(), nl=False)
