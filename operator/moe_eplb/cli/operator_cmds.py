"""``moe-eplb run``: start the operator (kopf embedded, peering, liveness probe, metrics)."""

from __future__ import annotations

import os

import click

from moe_eplb.exporter import names


def register(main: click.Group) -> None:
    main.add_command(run)


@click.command("run")
@click.option("--kubeconfig", type=click.Path(exists=True, dir_okay=False),
              help="Kubeconfig to use (default: in-cluster service account, else $KUBECONFIG / ~/.kube/config).")
@click.option("-n", "--namespace", "namespaces", multiple=True,
              help="Serve only this namespace (repeatable; globs allowed). Default: all namespaces.")
@click.option("--standalone", is_flag=True, help="No peering: act even if other operator replicas run.")
@click.option("--peering", "peering_name", default="moe-eplb", show_default=True,
              help="kopf peering object name (ClusterKopfPeering cluster-wide, KopfPeering with --namespace); "
                   "used when kopf's peering CRDs are installed.")
@click.option("--priority", type=int, default=0, show_default=True,
              help="Peering priority: the highest-priority replica is active, the others pause.")
@click.option("--liveness", "liveness_endpoint", default="http://0.0.0.0:8081/healthz", show_default=True,
              help="Liveness probe endpoint served by kopf ('' to disable).")
@click.option("--metrics-port", type=int, default=names.OPERATOR_PORT, show_default=True,
              help="Port of the operator's Prometheus /metrics (0 to disable).")
@click.option("--resync-seconds", type=float, default=60.0, show_default=True,
              help="Period of the drift/status resync of every MoEInference.")
@click.option("-v", "--verbose", is_flag=True, help="More logs.")
@click.option("--debug", is_flag=True, help="Debug logs (every API call).")
def run(kubeconfig: str | None, namespaces: tuple[str, ...], standalone: bool, peering_name: str, priority: int,
        liveness_endpoint: str, metrics_port: int, resync_seconds: float, verbose: bool, debug: bool) -> None:
    """Run the MoEInference operator until interrupted (SIGINT/SIGTERM stop it gracefully)."""
    import kopf

    from moe_eplb.controller.handlers import Controller
    from moe_eplb.controller.main import reconcile_counter, main as run_main, start_metrics_server

    if kubeconfig:
        os.environ["KUBECONFIG"] = os.path.abspath(kubeconfig)
    kopf.configure(verbose=verbose, debug=debug)
    counter = None
    if metrics_port:
        start_metrics_server(metrics_port)
        counter = reconcile_counter()
    controller = Controller(resync_seconds=resync_seconds, counter=counter)
    run_main(controller=controller, clusterwide=not namespaces, namespaces=namespaces, standalone=standalone,
             peering_name=peering_name, priority=priority, liveness_endpoint=liveness_endpoint or None)
