"""The HTTP endpoints of the server: chat completions, models, metrics, and their errors."""
