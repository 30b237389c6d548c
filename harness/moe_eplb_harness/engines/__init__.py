"""The simulated engines: ``engine`` (a vLLM engine pod's stand-in: EPLB replayed over a workload,
the exporter's and vLLM's metrics served), ``physics`` (the deployment's true costs the engines
follow), ``recording`` (a trace one simulated engine served), ``fleet`` (replicas driven in-process
on a simulated clock: the experiment judge's benchmark). Imports only the product."""
