"""The simulated engines: ``engine`` (a vLLM engine pod's stand-in: EPLB replayed over a workload,
the exporter's and vLLM's metrics served), ``physics`` (the deployment's true costs the engines
follow), ``recording`` (a trace one simulated engine served), ``live_route`` (the exporter's
live-apply route as the simulated pods answer it). Imports only the product."""
