"""Plain helpers that know nothing of models, rings or HTTP: names, logs, tasks, the device, listeners, the `serve` command line, metrics."""
