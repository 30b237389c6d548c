"""Observing a MoEInference's workload for the tuning loop: its recent load and measured balancedness.

:class:`LoadObserver` (one per :class:`~moe_eplb.controller.autotune.AutotuneLoop`) reads

- the load of the last minutes (:meth:`LoadObserver.read_load`, via
  :func:`moe_eplb.metrics.reader.read_load_trace`): from Prometheus when the resource has a URL, else
  from the scrape rounds of the pods it keeps taking itself (direct mode,
  :meth:`LoadObserver.collect`), like Prometheus would;
- the balancedness the running pods achieve over a time range (:meth:`LoadObserver.measure`):
  from Prometheus, or by differencing the pods' rank counters against an earlier direct round.

Direct mode keeps per-resource state (the rounds, the rank counters, the scrape loop's task) in the
observer; :meth:`LoadObserver.close` ends the scrape loops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from moe_eplb.api.autotune_status import DataWindow, Measurement
from moe_eplb.api.spec import MoEInference
from moe_eplb.contracts import k8s_names
from moe_eplb.controller.autotune_settings import AutotuneSettings
from moe_eplb.eplb.workload.trace import LoadTrace
from moe_eplb.metrics import measure as measure_mod
from moe_eplb.metrics import reader
from moe_eplb.metrics.assemble import per_engine
from moe_eplb.metrics.errors import LoadReadError
from moe_eplb.metrics.promclient import PrometheusClient
from moe_eplb.metrics.scrape import PodScraper, targets_from_pods

log = logging.getLogger("moe_eplb.autotune")


class LoadUnavailable(Exception):
    """The load could not be read or is not enough to tune on; ``reason`` is a condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass
class _Direct:
    """Per-resource state of direct mode (no Prometheus): scrape rounds for the reader, rank
    counters for the judge."""

    scraper: PodScraper
    ranks: measure_mod.RankHistory = field(default_factory=measure_mod.RankHistory)
    last_collect: float | None = None  # clock time the pods were last listed
    pods: list = field(default_factory=list)  # as last listed: what the scrape loop scrapes
    touched: float = 0.0  # time.monotonic() of the last tick that wanted the loop
    task: asyncio.Task | None = None  # the scrape loop (:meth:`LoadObserver._scrape_loop`)


class LoadObserver:
    """Reads the load and measures balancedness of MoEInferences (see the module docstring)."""

    def __init__(self, settings: AutotuneSettings) -> None:
        self.settings = settings
        self._direct: dict[tuple[str, str], _Direct] = {}

    def direct(self, inf: MoEInference) -> _Direct:
        """The direct-mode state of a resource (created on first use)."""
        key = (inf.namespace or "default", inf.name)
        if key not in self._direct:
            self._direct[key] = _Direct(PodScraper(timeout=self.settings.http_timeout, keep=2000))
        return self._direct[key]

    async def close(self) -> None:
        """End the scrape loops (the operator stops)."""
        tasks = [d.task for d in self._direct.values() if d.task is not None and not d.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def read_replica_traces(self, inf: MoEInference, start: float, end: float,
                                  pods: list[dict]) -> dict[str, LoadTrace]:
        """Each replica's own load (a pod, or a LeaderWorkerSet group: :func:`moe_eplb.metrics.measure.
        engine_of_pod`) over the same window as :meth:`read_load`: one read per replica, restricted to its
        pods (from the pods directly: the rounds :meth:`read_load` just scraped), of the load and steps
        only (they are tuned with the shared evaluation's calibrated cost model: no telemetry is read).
        A replica whose read fails (a pod just joined) is left out."""
        groups: dict[str, set[str]] = {}
        for p in pods:
            meta = p.get("metadata") or {}
            if not meta.get("deletionTimestamp") and meta.get("name"):
                groups.setdefault(measure_mod.engine_of_pod(p), set()).add(meta["name"])
        out = {}
        for replica, names in sorted(groups.items()):
            try:
                out[replica], _ = await self.read_load(inf, start, end, pods, only_pods=frozenset(names),
                                                       telemetry=False)
            except LoadUnavailable as exc:
                log.info("autotune %s/%s: the load of replica %s: %s", inf.namespace, inf.name, replica, exc)
        return out

    async def read_load(self, inf: MoEInference, start: float, end: float,
                        pods: list[dict], *, only_pods: frozenset[str] | None = None,
                        telemetry: bool = True) -> tuple[LoadTrace, DataWindow]:
        """The load of the last ``end - start`` clock seconds (:func:`moe_eplb.metrics.reader.read_load_trace`):
        from Prometheus when a URL is known, in buckets of ``settings.bucket_seconds`` clock seconds; else from
        the rounds :meth:`collect` scraped on earlier ticks plus one now. The trace's
        ``bucket_seconds`` is in clock seconds (an accelerated clock keeps the step rate right)."""
        rt, url, shape = self.settings, inf.prometheus_url, inf.moe_shape
        scale = rt.scale
        kwargs = dict(namespace=inf.namespace or "default", name=inf.name, window_seconds=(end - start) / scale,
                      bucket_seconds=self.bucket_seconds() / scale,
                      num_layers=shape.num_moe_layers, num_experts=shape.num_experts,
                      pods_per_engine=max(1, int(inf.parallelism.nodes or 1)), timeout=rt.http_timeout,
                      budget=rt.prometheus_budget_seconds, only_pods=only_pods, telemetry=telemetry)
        try:
            if url:
                trace = await asyncio.to_thread(reader.read_load_trace, prometheus_url=url, now=rt.clock.to_wall(end),
                                                **kwargs)
                log.debug("autotune %s/%s: load read from Prometheus, %s (%s pods summed at the bucket edges, %s raw)",
                          inf.namespace, inf.name, trace.meta.get("read"), trace.meta.get("pods_at_edges"),
                          trace.meta.get("pods_raw"))
            else:
                trace = await asyncio.to_thread(reader.read_load_trace, pods=pods, scraper=self.direct(inf).scraper,
                                                **kwargs)
                log.debug("autotune %s/%s: load %s", inf.namespace, inf.name, trace.meta.get("read"))
        except LoadReadError as exc:
            raise LoadUnavailable(exc.reason, exc.message) from exc
        except (asyncio.CancelledError, LoadUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in the reader must not kill the loop
            raise LoadUnavailable("LoadReadError", f"{type(exc).__name__}: {exc}") from exc
        trace = per_engine(trace)  # one engine's load and steps, whatever the replica count (autoscaling)
        if trace.bucket_seconds and scale != 1.0:
            trace = LoadTrace(load=trace.load, bucket_steps=trace.bucket_steps, bucket_seconds=trace.bucket_seconds * scale,
                              top_k=trace.top_k, model=trace.model, meta=trace.meta, telemetry=trace.telemetry)
        span = trace.num_buckets * (trace.bucket_seconds or 0.0)
        window = DataWindow(start=end - span if span else start, end=end, buckets=trace.num_buckets,
                            steps=trace.total_steps, source="prometheus" if url else "pods")
        return trace, window

    def scrape_seconds(self) -> float:
        """Clock seconds between two direct scrapes of a resource's pods: half the load read's bucket
        (the bucket is at least ``settings.min_wall_bucket_seconds`` of wall time), so that every bucket holds a
        scrape as it holds >= 2 of Prometheus'."""
        return self.bucket_seconds() / 2

    def bucket_seconds(self) -> float:
        """The load read's bucket in clock seconds: ``settings.bucket_seconds``, at least
        ``settings.min_wall_bucket_seconds`` of wall time."""
        rt = self.settings
        return max(rt.bucket_seconds, rt.min_wall_bucket_seconds * rt.scale)

    def min_read_seconds(self) -> float:
        """The shortest span (clock seconds) :meth:`measure` reads reliably, at least a bucket of the
        load read: two scrapes, ``settings.min_wall_bucket_seconds`` of wall time where set, else two of
        the rendered monitor's (``k8s_names.SCRAPE_INTERVAL_SECONDS``; :meth:`collect`'s loop
        scrapes at least as often)."""
        rt = self.settings
        two_scrapes = rt.min_wall_bucket_seconds or 2.0 * k8s_names.SCRAPE_INTERVAL_SECONDS
        return max(self.bucket_seconds(), two_scrapes * rt.scale)

    async def collect(self, client: Any, inf: MoEInference, now: float) -> None:
        """Without Prometheus, keep the resource's pods scraped, like Prometheus would, by a loop of its
        own (:meth:`_scrape_loop`, every :meth:`scrape_seconds`): the reader then has rounds at
        evaluation time in every bucket, also those in which this resource's tick was busy (a tuner run
        takes seconds) -- scraping from the tick left gaps that spoilt the next read. Lists the pods for
        the loop at most once per scrape period. Errors are left to the evaluation."""
        direct = self.direct(inf)
        direct.touched = time.monotonic()
        if direct.last_collect is None or now - direct.last_collect >= self.scrape_seconds():
            direct.last_collect = now
            ns = inf.namespace or "default"
            direct.pods = await client.list("v1", "Pod", ns, label_selector=f"{k8s_names.NAME_LABEL}={inf.name}")
        if direct.task is None or direct.task.done():
            direct.task = asyncio.get_running_loop().create_task(self._scrape_loop(direct, inf.namespace or "default",
                                                                                   inf.name))

    async def _scrape_loop(self, direct: _Direct, namespace: str, name: str) -> None:
        """Scrape the pods ``direct.pods`` lists every :meth:`scrape_seconds` (wall time on an
        accelerated clock) into the reader's and the judge's histories; ends when no tick has asked for
        it for a while (resource deleted, Prometheus configured, operator stopped)."""
        rt = self.settings
        period = self.scrape_seconds() / rt.scale
        idle = max(10 * rt.tick_seconds, 4 * period)
        while time.monotonic() - direct.touched < idle:
            started = time.monotonic()
            pods, now = direct.pods, rt.clock.now()
            targets = targets_from_pods(pods, name)
            if targets:  # one fetch per pod feeds both the reader and the judge
                try:
                    rnd = await asyncio.to_thread(direct.scraper.scrape, targets)
                    direct.ranks.remember(now, measure_mod.rank_counts_of_round(rnd, pods))
                except LoadReadError as exc:
                    log.info("autotune: scraping %s/%s: %s", namespace, name, exc)
                except Exception as exc:  # noqa: BLE001 - a bug must not end the loop silently; the next round tries again
                    log.warning("autotune: scraping %s/%s: %s: %s", namespace, name, type(exc).__name__, exc)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def measure(self, inf: MoEInference, pods: list[dict], start: float, end: float) -> Measurement | None:
        """Measured balancedness of the running pods over clock seconds ``[start, end]``: from Prometheus
        when a URL is known, else by scraping the pods and differencing against an earlier round."""
        rt, url = self.settings, inf.prometheus_url
        try:
            if url:
                client = PrometheusClient(url, timeout=rt.http_timeout, budget=rt.prometheus_budget_seconds)
                return await asyncio.to_thread(measure_mod.measure_prometheus, client, inf.namespace or "default",
                                               inf.name, rt.clock.to_wall(start), rt.clock.to_wall(end))
            counts = await asyncio.to_thread(measure_mod.scrape_rank_counts, pods, rt.http_timeout)
            engines = {p["metadata"]["name"]: measure_mod.engine_of_pod(p) for p in pods}
            return self.direct(inf).ranks.measure(counts, start, end, engines=engines)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no measurement: the rollout waits or keeps on prediction
            log.warning("autotune: measuring balancedness failed: %s", exc)
            return None
