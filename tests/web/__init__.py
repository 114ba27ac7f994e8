"""The web chat in a real Chromium, against a real ``tokenbelt serve``."""
