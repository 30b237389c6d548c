"""The kopf settings the operator runs with (``moe_eplb.controller.main.build_settings``) where they
change what a user sees."""

from __future__ import annotations

from moe_eplb.controller.main import CANCELLATION_POLLING_S, build_settings


def test_a_deletion_waits_seconds_not_a_minute_for_a_timer_call_in_flight() -> None:
    """kopf holds a resource's deletion until its timers' calls in flight end, and checks for that
    every ``background.cancellation_polling`` seconds: 60 by default, so deleting a MoEInference
    while its autotune tick ran took a minute (tests/controller/test_rbac.py's lifecycle saw 40 s
    pass on a loaded machine). The operator checks every second."""
    assert kopf_default_polling() == 60
    settings = build_settings()
    assert settings.background.cancellation_polling == CANCELLATION_POLLING_S == 1.0
    assert build_settings(standalone=True, clusterwide=False).background.cancellation_polling == 1.0


def kopf_default_polling() -> float:
    import kopf

    return kopf.OperatorSettings().background.cancellation_polling
