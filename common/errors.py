"""Errors of the modules the proxy and the worker share.

    CommonError
    ├── TokenizerError
    │   ├── TokenizerLoadError   the tokenizer files are missing or malformed
    │   └── ChatTemplateError    the messages do not fit the chat template (a bad request)
    ├── ListenError              a server cannot listen on its address (the port is in use, ...)
    └── RegistrationError        a worker record is malformed, or registering it in etcd failed
                                 (etcd unreachable, lease lost: neuron_connector.registry)
"""
from __future__ import annotations


class CommonError(Exception):
    """Base class of every error raised in `common`."""


class TokenizerError(CommonError):
    pass


class TokenizerLoadError(TokenizerError):
    pass


class ChatTemplateError(TokenizerError, ValueError):
    pass


class ListenError(CommonError, OSError):
    pass


class RegistrationError(CommonError):
    pass
