"""``moe-eplb demo``: the closed tuning loop on a simulated cluster (:mod:`moe_eplb_harness.demo.tuning`,
:mod:`moe_eplb_harness.demo.autoscale`).

The harness registers this command with the product's CLI through the entry point group
``moe_eplb.commands`` (``harness/pyproject.toml``), the way the exporter registers with vLLM; the
product never imports the harness. Importing this module loads click only: the demo's modules are
imported when the command runs.
"""

from __future__ import annotations

import click


@click.command("demo")
@click.option("--scenario", type=click.Choice(["tuning", "autoscale"]), default="tuning", show_default=True,
              help="tuning: two resources tuned through a workload shift; autoscale: one autoscaled resource "
                   "through a traffic rise, a scale-out and the tuner waiting for it to settle (docs/demo.md).")
@click.option("--hours", type=click.FloatRange(min=0.5), default=None,
              help="Simulated hours of workload [default: 3 (tuning: the domain shift comes half-way), "
                   "2 (autoscale)].")
@click.option("--speed", type=click.FloatRange(min=1.0), default=None,
              help="Simulated seconds per wall second [default: 50 (tuning), 40 (autoscale)].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/demo", show_default=True,
              help="Directory for the report (report.md, plots, decisions.json, summary.json).")
@click.option("--prometheus/--no-prometheus", default=None,
              help="Use a real Prometheus (default: when one is found, the Debian package's or make "
                   "prometheus's) or have the operator "
                   "scrape the pods directly (--no-prometheus).")
@click.option("--api", type=click.Choice(["auto", "real", "emulated"]), default="auto", show_default=True,
              help="Kubernetes API: a real control plane (kube-apiserver, controller manager, scheduler built "
                   "by `make kube`), the in-process emulation, or auto (real when built).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload generator seed.")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the run's summary here (JSON; tuning: shift_at_s, api, load_source; per resource "
                   "its kind, mode, applied changes, live changes (window and interval on the running engines) and "
                   "balancedness tuned/untuned; autoscale: the autoscaler, "
                   "scale events, the tuner's deferrals, its decision after settling, rollouts started while "
                   "scaling).")
def demo(scenario: str, hours: float | None, speed: float | None, out_dir: str, prometheus: bool | None, api: str,
         seed: int, summary_path: str | None) -> None:
    """Run the operator's closed tuning loop on a SIMULATED cluster in accelerated time.

    Starts a real Kubernetes control plane when `make kube` has built one (else the API
    emulation; --api chooses), simulated vLLM engine pods (they replay a generated
    workload through EPLB and serve the exporter's metrics), a real Prometheus when installed,
    and the real operator; applies two MoEInferences in autotune Apply mode -- Qwen3-VL-30B-A3B
    on one node (a Deployment) and DeepSeek-V3 at EP 32 over 4 nodes (a LeaderWorkerSet);
    prints each decision; writes a report and prints balancedness tuned vs untuned per resource.

    --scenario autoscale: one MoEInference with spec.autoscaling (HPA on vLLM's waiting requests)
    through a traffic rise; the autoscaler (the real HPA controller via prometheus-adapter on the
    real control plane, else an emulated one: the first line says which) scales it out, the tuner
    defers its rollout until the new replicas have settled, then decides.
    On failure the last line says what failed (exit 1).
    """
    import asyncio
    import time

    from moe_eplb_harness.demo.tuning import failure_line, run_demo

    t0 = time.monotonic()
    try:
        if scenario == "autoscale":
            from moe_eplb_harness.demo import autoscale as auto

            asyncio.run(auto.run_autoscale_demo(
                hours=auto.DEFAULT_HOURS if hours is None else hours, speed=auto.DEFAULT_SPEED if speed is None else speed,
                out_dir=out_dir, prometheus=prometheus, seed=seed, summary_path=summary_path,
                echo=lambda s: click.echo(s), api=api))
        else:
            asyncio.run(run_demo(hours=3.0 if hours is None else hours, speed=50.0 if speed is None else speed,
                                 out_dir=out_dir, prometheus=prometheus, seed=seed, summary_path=summary_path,
                                 echo=lambda s: click.echo(s), api=api))
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - any failure: its reason as the last line
        import gc
        import sys

        gc.collect()  # what the run left unclosed warns now, before the reason
        sys.stdout.flush()
        click.echo(failure_line(exc, time.monotonic() - t0), err=True)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 1)
