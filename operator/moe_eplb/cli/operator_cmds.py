"""``moe-eplb run``: start the operator (kopf embedded, peering, liveness probe, metrics).

Every option also reads an environment variable (shown in ``--help``; the Helm chart sets them);
the values become a :class:`moe_eplb.controller.settings.OperatorSettings` (checked there).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import click

from moe_eplb.contracts import k8s_names
from moe_eplb.controller import settings as s


def register(main: click.Group) -> None:
    main.add_command(run)


def _env(setting: str) -> dict[str, Any]:
    return {"envvar": s.OPTIONS[setting][1], "show_envvar": True}


class _NamespaceList(click.ParamType):
    """A namespace, or a comma-separated list of them (as in ``MOE_EPLB_NAMESPACES=a,b``)."""

    name = "namespace"
    envvar_list_splitter = ","

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return str(value)


@click.command("run")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False), **_env("kubeconfig"),
              help="Kubeconfig to use (default: in-cluster service account, else $KUBECONFIG / ~/.kube/config).")
@click.option("--prometheus-url", **_env("prometheus_url"),
              help="Default Prometheus base URL for MoEInferences without spec.monitoring.prometheusUrl "
                   "(default: none, the tuner reads the pods' exporters directly).")
@click.option("-n", "--namespace", "namespaces", multiple=True, type=_NamespaceList(), **_env("namespaces"),
              help="Serve only this namespace (repeatable or comma-separated; globs allowed). "
                   "Default/empty: all namespaces.")
@click.option("--standalone", is_flag=True, **_env("standalone"),
              help="No peering: act even if other operator replicas run.")
@click.option("--peering", "peering_name", default=None, show_default=s.PEERING_NAME, **_env("peering_name"),
              help="kopf peering object name (ClusterKopfPeering cluster-wide, KopfPeering with --namespace); "
                   "used when kopf's peering CRDs are installed. Empty (also an empty env var): standalone.")
@click.option("--priority", type=int, default=None, **_env("priority"),
              help="Peering priority: the highest-priority replica acts, the others pause. Default: by "
                   "seniority (the earlier-started replica is higher, a random tie-break makes each process "
                   f"differ), in [{s.PRIORITY_RANGE[0]}, {s.PRIORITY_RANGE[1]}].")
@click.option("--health-port", type=int, default=None, show_default=str(s.DEFAULT_HEALTH_PORT),
              **_env("health_port"), help="Port of the liveness endpoint http://0.0.0.0:PORT/healthz (0 to disable).")
@click.option("--liveness", "liveness", default=None, **_env("liveness"),
              help="Full liveness endpoint URL served by kopf, e.g. http://127.0.0.1:8081/healthz "
                   "(overrides --health-port; '' to disable).")
@click.option("--metrics-port", type=int, default=k8s_names.OPERATOR_METRICS_PORT, show_default=True, **_env("metrics_port"),
              help="Port of the operator's Prometheus /metrics (0 to disable).")
@click.option("--resync-seconds", type=float, default=60.0, show_default=True, **_env("resync_seconds"),
              help="Period of the drift/status resync of every MoEInference.")
@click.option("--log-level", type=click.Choice(s.LOG_LEVELS, case_sensitive=False), default="INFO",
              show_default=True, **_env("log_level"), help="Log level.")
@click.option("--log-format", type=click.Choice(s.LOG_FORMATS, case_sensitive=False), default="text",
              show_default=True, **_env("log_format"),
              help="text: timestamped lines; json: one JSON object per line (kopf's JSON formatter).")
@click.option("--pod-monitor-labels", default=None, **_env("pod_monitor_labels"),
              help='Labels every rendered PodMonitor carries, as key=value,key=value or a JSON object, e.g. '
                   'release=kube-prometheus-stack (what that stack\'s Prometheus selects PodMonitors by); '
                   "a resource's spec.monitoring.podMonitor.labels win.")
@click.option("--exporter-image", default=None, **_env("exporter_image"),
              help="Image of the exporter-injection init container for resources without "
                   "spec.engine.exporter.image (default: the operator image of this version; the chart sets "
                   "the image it runs).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logs (same as --log-level DEBUG).")
@click.option("--debug", is_flag=True, help="Debug logs, including every API call kopf makes.")
@click.pass_context
def run(ctx: click.Context, kubeconfig: str | None, verbose: bool, debug: bool, **values: Any) -> None:
    """Run the MoEInference operator until interrupted (SIGINT/SIGTERM stop it gracefully).

    POD_NAME / POD_NAMESPACE (downward API) name the replica: POD_NAME becomes kopf's peering id.
    """
    try:
        settings = settings_from_cli(ctx, values, os.environ)
    except s.SettingsError as exc:
        raise click.UsageError(str(exc)) from exc
    if verbose or debug:
        settings = dataclasses.replace(settings, log_level="DEBUG")

    from moe_eplb.controller.handlers import Controller
    from moe_eplb.controller.main import (
        configure_logging,
        reconcile_counter,
        start_metrics_server,
    )
    from moe_eplb.controller.main import main as run_main

    if kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(kubeconfig)
    if settings.pod_name:
        os.environ.setdefault("POD_ID", settings.pod_name)  # kopf's peering identity
    log = configure_logging(settings.log_level, settings.log_format, debug=debug)
    for env in s.RETIRED_ENV:
        if env in os.environ:
            log.warning("%s is no longer read: spec.autotune fields are defaulted by the CRD; set them per "
                        "MoEInference", env)
    log.info("moe-eplb operator: %s, peering %s (priority %d), prometheus %s",
             "all namespaces" if settings.clusterwide else ",".join(settings.namespaces),
             "off (standalone)" if settings.standalone else
             settings.peering_name + (" (required)" if settings.peering_required else ""), settings.priority,
             settings.prometheus_url or "none (pods read directly)")
    counter = None
    if settings.metrics_port:
        start_metrics_server(settings.metrics_port)
        counter = reconcile_counter()
    controller = Controller(resync_seconds=settings.resync_seconds, counter=counter, settings=settings)
    run_main(controller=controller, clusterwide=settings.clusterwide, namespaces=settings.namespaces,
             standalone=settings.standalone, peering_name=settings.peering_name, priority=settings.priority,
             liveness_endpoint=settings.liveness_endpoint, peering_required=settings.peering_required)


def settings_from_cli(ctx: click.Context, values: Mapping[str, Any], environ: Mapping[str, str]) -> s.OperatorSettings:
    """Parsed ``run`` option values -> settings. An env variable set to '' is "unset" for click;
    for MOE_EPLB_PEERING it means standalone (the chart's ``peering.enabled=false``)."""
    peering = values.get("peering_name")
    source = ctx.get_parameter_source("peering_name")
    if peering is None and source == click.core.ParameterSource.DEFAULT \
            and environ.get(s.OPTIONS["peering_name"][1]) == "":
        peering = ""
    # a name given on purpose (flag or env, as the chart does) makes peering mandatory
    required = bool(peering) and source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return s.build(
        prometheus_url=values.get("prometheus_url"), namespaces=values.get("namespaces") or (),
        standalone=bool(values.get("standalone")), peering_name=peering, priority=values.get("priority"),
        health_port=values.get("health_port"), liveness=values.get("liveness"),
        metrics_port=values["metrics_port"], resync_seconds=values["resync_seconds"],
        log_level=values["log_level"], log_format=values["log_format"],
        pod_name=environ.get("POD_NAME"), pod_namespace=environ.get("POD_NAMESPACE"),
        pod_monitor_labels=values.get("pod_monitor_labels"), exporter_image=values.get("exporter_image"),
        peering_required=required)

