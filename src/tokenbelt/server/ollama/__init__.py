"""The Ollama dialect."""
