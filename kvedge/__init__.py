"""kvedge: run an LLM chatbot on an NVIDIA Jetson with a KV cache that is exact, small and fast."""

__version__ = "0.1.0"
