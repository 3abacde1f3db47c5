"""Models on disk: mlx-lm directories, the Hub, GGUF files, Ollama's store, wheels on a package index; tiny test models; load progress."""
