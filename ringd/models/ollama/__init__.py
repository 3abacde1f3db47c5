"""Ollama's models as Ollama runs them: its store, its options, its Go chat templates, its keep_alive durations."""
