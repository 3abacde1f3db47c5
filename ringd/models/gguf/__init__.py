"""GGUF files (llama.cpp's format) read as mlx-lm checkpoints: the header, the quantized blocks, each architecture's facts, the vocabulary."""
