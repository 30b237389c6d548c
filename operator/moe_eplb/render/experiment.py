"""The workloads of an experiment's two arms (pure): what :func:`moe_eplb.render.objects.render_children`
renders while a cross-pod experiment is set in ``status.autotune.experiment`` past its pre-period
(:mod:`moe_eplb.controller.experiment`; :func:`renders_arms`: an interleaved experiment, or the
pre-period, renders the workload as without one).

Deployment (single-node replicas): the trial is a second Deployment, ``<name>-trial``, of ONE pod
with the trial's EPLB settings, its pods labelled ``eplb.ai/arm: trial`` (its selector adds that
label), behind the same Service (whose selector matches both). The main Deployment keeps the
control's settings with one replica fewer, so the total stays ``spec.replicas``. While a pod of one
arm starts (the trial in ``Starting``, the main Deployment's replacement in ``Restoring`` and after
a promotion) the other arm keeps its pod only when ``spec.rollout.maxSurge`` allows an extra one
(spare GPUs); otherwise the capacity floor ``replicas - maxUnavailable`` holds with one pod down.

==============  ====================================  ================================
phase           main Deployment                       trial Deployment
==============  ====================================  ================================
Starting        control, N (surge) or N - 1           trial settings, 1
Running         control, N - 1                        trial settings, 1
Promoting       trial settings (the override), N - 1  trial settings, 1
Restoring       control, N                            1 (surge) or none
==============  ====================================  ================================

After a promotion the loop ends the experiment once the main Deployment's N - 1 pods run the
trial's settings; the trial Deployment is pruned then and the main one scales back to N (the
override renders the trial's settings).

LeaderWorkerSet (multi-node replica groups): one object; its template carries the trial's
settings and ``rollingUpdateConfiguration.partition: N - 1`` keeps groups 0..N-2 on the control's
(LeaderWorkerSet updates only the groups at or above the partition). Promoting: the partition goes
to 0 and every group rolls to the trial's settings (the override); Restoring: the template returns
to the control's settings and the trial group rolls back.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from moe_eplb.api.autotune_status import BASELINE, INTERLEAVED, PROMOTING, RESTORING, RUNNING, STARTING, Experiment
from moe_eplb.api.spec import EplbSettings, MoEInference
from moe_eplb.contracts.k8s_names import ARM_LABEL, ARM_TRIAL, TRIAL_SUFFIX


def renders_arms(exp: Experiment) -> bool:
    """Whether the experiment has workloads of its own: a cross-pod one past its pre-period. An
    interleaved experiment runs on the pods as they are (its settings change live, not in the
    template); during the pre-period (``Baseline``) every pod still runs the running settings."""
    return exp.design != INTERLEAVED and exp.phase != BASELINE


def trial_name(name: str) -> str:
    """The trial Deployment's name."""
    return f"{name}{TRIAL_SUFFIX}"


def trial_settings(inf: MoEInference, exp: Experiment) -> EplbSettings:
    """The trial arm's EPLB settings: the running ones with the trial's knobs."""
    return dataclasses.replace(inf.effective, knobs=exp.trial.knobs, source="experiment")


def _template_for(inf: MoEInference, knobs) -> EplbSettings:
    """The pod-template settings that run ``knobs``: the template as it is when they are what runs
    now -- its own, or with the window and interval applied live over it (``status.autotune.live``,
    kept for restarted pods by the live-settings ConfigMap) -- so the control arm is not restarted."""
    if knobs == inf.running_knobs:
        return inf.effective
    return dataclasses.replace(inf.effective, knobs=knobs)


def control_settings(inf: MoEInference, exp: Experiment) -> EplbSettings:
    """The control arm's EPLB settings: the running ones (after a promotion: the override's)."""
    if exp.phase == PROMOTING:
        return dataclasses.replace(inf.effective, knobs=exp.trial.knobs)
    return _template_for(inf, exp.control.knobs)


def deployment_arms(inf: MoEInference, exp: Experiment, build) -> list[dict[str, Any]]:
    """The main Deployment (control arm) and, while the trial runs, the trial Deployment; ``build``
    is :func:`moe_eplb.render.objects.deployment` (``(inf, eplb) -> manifest``)."""
    n, surge = int(inf.replicas), inf.rollout.max_surge >= 1
    main_replicas = {STARTING: n if surge else n - 1, RUNNING: n - 1, PROMOTING: n - 1, RESTORING: n}
    main = build(inf, control_settings(inf, exp))
    # a scale-in to one replica keeps that replica serving until the loop ends the experiment
    main["spec"]["replicas"] = max(min(n, 1), main_replicas.get(exp.phase, n))
    out = [main]
    if exp.phase != RESTORING or surge:
        out.append(trial_deployment(inf, build(inf, trial_settings(inf, exp))))
    return out


def trial_deployment(inf: MoEInference, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a Deployment rendered with the trial's settings) as the trial workload: one pod,
    named ``<name>-trial``, pods and selector with ``eplb.ai/arm: trial``."""
    d = copy.deepcopy(base)
    d["metadata"]["name"] = trial_name(inf.name)
    d["metadata"]["labels"] = {**d["metadata"]["labels"], ARM_LABEL: ARM_TRIAL}
    d["spec"]["replicas"] = 1
    d["spec"]["selector"] = {"matchLabels": {**d["spec"]["selector"]["matchLabels"], ARM_LABEL: ARM_TRIAL}}
    tmeta = d["spec"]["template"]["metadata"]
    tmeta["labels"] = {**tmeta.get("labels", {}), ARM_LABEL: ARM_TRIAL}
    return d


def lws_arms(inf: MoEInference, exp: Experiment, build) -> list[dict[str, Any]]:
    """The LeaderWorkerSet with the trial's settings on its highest group (``partition: N - 1``),
    on every group once promoted, back on the control's while restoring; ``build`` is
    :func:`moe_eplb.render.objects.leader_worker_set`."""
    n = int(inf.replicas)
    if exp.phase == RESTORING or (n < 2 and exp.phase in (STARTING, RUNNING)):
        # a scale-in to one group removed the trial's (the highest index): the one left stays as it is
        return [build(inf, _template_for(inf, exp.control.knobs))]
    lws = build(inf, trial_settings(inf, exp))
    if exp.phase in (STARTING, RUNNING):
        ru = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
        ru["partition"] = max(0, n - 1)
    return [lws]
