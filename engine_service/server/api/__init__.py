"""The HTTP face of a replica: health, readiness, Prometheus metrics and the OpenAI API."""
