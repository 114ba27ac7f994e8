"""The OpenAI dialect."""
