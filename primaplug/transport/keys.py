"""The cluster key pair: one CurveZMQ key pair shared by every device of a cluster.

Every socket a device binds is a Curve server with this key, and accepts only clients that prove they hold its
secret half, so a peer without the key file can neither connect nor read the traffic.

zmq is imported by the two functions that need it, not here: ClusterKeys is a plain value that the in-process
transport and type hints use without loading ZeroMQ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from primaplug.core.errors import ConfigError


@dataclass(frozen=True)
class ClusterKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes = b""

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKeys(public={self.public.decode()!r})"


def generate_keys(path: str | os.PathLike[str]) -> ClusterKeys:
    """Write a new cluster key file (mode 0600); refuses to overwrite one."""
    p = Path(path)
    if p.exists():
        raise ConfigError(f"{p} exists; remove it first if you mean to replace the cluster key")
    import zmq

    public, secret = zmq.curve_keypair()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# primaplug cluster key: copy this file to every node and to the head, and keep it secret\n"
                f'public = "{public.decode()}"\nsecret = "{secret.decode()}"\n')
    return ClusterKeys(public, secret)


def load_keys(path: str | os.PathLike[str]) -> ClusterKeys:
    import tomllib  # here, not at the top: 0.6 MiB in every node and head, and only a process with keys reads them

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
        public, secret = data["public"].encode(), data["secret"].encode()
    except FileNotFoundError:
        raise ConfigError(f"no key file at {p}: make one with `primaplug keygen {p}`") from None
    except (tomllib.TOMLDecodeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{p} is not a primaplug key file ({e}): make one with `primaplug keygen`") from None
    if len(public) != 40 or len(secret) != 40:
        raise ConfigError(f"{p}: keys must be 40-character Z85 strings")
    import zmq

    if zmq.curve_public(secret) != public:
        raise ConfigError(f"{p}: the public key does not belong to the secret key")
    return ClusterKeys(public, secret)
