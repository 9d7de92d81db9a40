"""Checkpoint readers behind `jaxspec.weights.load_model`: HF directories, GGUF files, and the
on-disk cache of converted params."""
