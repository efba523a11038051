"""The service around the engine: the Redis replica, its HTTP/OpenAI app, metrics, `play`."""
