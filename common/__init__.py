"""What the proxy, the connector and the worker share, with nothing but the stdlib behind it
(except request_body, for the two Quart apps: the proxy's and the worker's)."""
