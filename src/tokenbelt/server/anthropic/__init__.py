"""The Anthropic dialect."""
