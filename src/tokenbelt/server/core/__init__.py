"""The serving core every dialect shares."""
