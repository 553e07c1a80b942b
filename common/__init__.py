"""What the processes agree on: worker roles and default ports, worker records, the KV block hash, the
OpenAI wire format, the KV secret, the tokenizer both sides encode prompts with, and request bodies of the
two Quart apps (the proxy's and the worker's).

It imports no package of ours and never torch: the proxy imports it and nothing else of ours. Beside the
stdlib it uses tokenizers and jinja2 (tokenizer.py) and quart (request_body.py).
"""
