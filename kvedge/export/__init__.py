"""Offline export: Hugging Face model (folder or GGUF) -> ONNX graph + tokenizer + manifest."""
