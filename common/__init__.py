"""What the proxy, the connector and the worker share, with nothing but the stdlib behind it."""
