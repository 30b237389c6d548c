"""The workload: ``trace`` (``LoadTrace``), ``tracefile`` (trace files, real routing data files),
``profiles`` (fits to real routing data, workload profiles), ``synth`` (the generator). Imports
neither ``replay`` nor ``tuning``."""
