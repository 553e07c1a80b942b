"""The KV plane's shared secret: loading it, and HMAC proofs that a peer holds it.

Every worker of one deployment reads the same secret file (`--kv-secret-file PATH`, or the
`NEURON_DI_KV_SECRET_FILE` environment variable). The signal plane and the tcp transport
prove they hold it with HMAC-SHA256 over fresh nonces, so a recorded exchange cannot be
replayed; nothing is encrypted. Without a secret the KV plane is unauthenticated.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import Any

SECRET_FILE_ENV = "NEURON_DI_KV_SECRET_FILE"
NO_SECRET_ID = "none"
_NONCE_BYTES = 16
_ID_SALT, _ID_ROUNDS = b"neuron-di KV secret id", 100_000


class KVSecretError(ValueError):
    """The secret file is missing, unreadable, empty or readable by group or others."""


def load_secret(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace stripped); KVSecretError says what is wrong."""
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as handle:
            secret = handle.read().strip()
    except OSError as exc:
        raise KVSecretError(f"cannot read the KV secret file {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KVSecretError(f"the KV secret file {path} is accessible by group or others "
                            f"(mode {stat.S_IMODE(mode):04o}); make it private: chmod 600 {path}")
    if not secret:
        raise KVSecretError(f"the KV secret file {path} is empty")
    return secret


def resolve_secret(path: str | None) -> bytes | None:
    """The secret from `path`, else from the file named by NEURON_DI_KV_SECRET_FILE, else None."""
    path = path or os.environ.get(SECRET_FILE_ENV) or None
    return None if path is None else load_secret(path)


def secret_id(secret: bytes | None) -> str:
    """What a worker shows of its KV secret (in its record), so that the proxy can tell whether two workers
    share one without learning it: NO_SECRET_ID, or 8 bytes of a slow key derivation, which makes guessing
    a weak secret from it costly (the documented secret is 32 random bytes, which cannot be guessed)."""
    if secret is None:
        return NO_SECRET_ID
    return "pbkdf2:" + hashlib.pbkdf2_hmac("sha256", secret, _ID_SALT, _ID_ROUNDS, dklen=8).hex()


def new_nonce() -> str:
    """A fresh random nonce, hex."""
    return secrets.token_hex(_NONCE_BYTES)


def proof(secret: bytes, label: bytes, *parts: str) -> str:
    """HMAC-SHA256 of `label` and `parts`, each length-prefixed so no two inputs collide; hex."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for field in (label, *(p.encode() for p in parts)):
        mac.update(len(field).to_bytes(4, "big") + field)
    return mac.hexdigest()


def verify(secret: bytes, label: bytes, claimed: object, *parts: str) -> bool:
    """Whether `claimed` is the proof of `parts` under `label` (constant-time comparison)."""
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), proof(secret, label, *parts).encode())


def describe_plane(host: str, signal_port: int | None, transports: dict[str, Any], secret: bytes | None) -> str:
    """One start-up line: where the KV plane listens (the signal plane's port on a prefill worker, the
    transports of a transfer descriptor), who can reach it, and whether it is authenticated."""
    where = [f"signal plane {host}:{signal_port}"] if signal_port is not None else []
    where += [f"{name} {info['host']}:{info['port']}" for name, info in transports.items()
              if isinstance(info, dict) and "host" in info and "port" in info]
    where += ["shm segment (this host's user only, mode 0600)" for name in transports if name == "shm"]
    reach = ("loopback: reachable only from this host" if host in ("127.0.0.1", "::1", "localhost")
             else "reachable from other hosts")
    auth = ("authenticated with the shared KV secret (HMAC; not encrypted)" if secret is not None
            else f"NOT authenticated (no --kv-secret-file or {SECRET_FILE_ENV})")
    return f"KV plane listens on {', '.join(where) or 'no socket'} ({reach}); {auth}"
