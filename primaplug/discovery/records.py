"""What a node announces (the TXT record of its DNS-SD service) and what a head makes of one: pure values, no
network.

An announcement holds no secret: the protocol version, the node's name, its ring port, short identities of the
models it holds and a fingerprint of the cluster's *public* key ("none" for a node without keys). The fingerprint
only sorts announcements into clusters; the proof that a node holds the key is its answer over CurveZMQ
(admission.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from primaplug.core.errors import ProtocolError
from primaplug.transport.keys import ClusterKeys
from primaplug.wire import PROTOCOL_VERSION

SERVICE_TYPE = "_primaplug._tcp.local."
NO_KEY = "none"  # the fingerprint of a node without keys (loopback only)
TXT_VALUE_BYTES = 255  # a TXT string's limit (RFC 6763), "key=" included
FINGERPRINT_CHARS = 16  # 64 bits of SHA-256: tells clusters apart, proves nothing (the handshake does)
MODEL_ID_HASH_CHARS = 12


def fingerprint(keys: ClusterKeys | None) -> str:
    """A short hash of the cluster's public key, or NO_KEY."""
    if keys is None:
        return NO_KEY
    return hashlib.sha256(keys.public).hexdigest()[:FINGERPRINT_CHARS]


def short_model_id(identity: str) -> str:
    """A model identity ('SIZE:SHA256-PREFIX', engine ModelLayout.identity) cut to fit an announcement."""
    size, _, digest = identity.partition(":")
    return f"{size}:{digest[:MODEL_ID_HASH_CHARS]}" if digest else identity


@dataclass(frozen=True)
class Found:
    """A node as its announcement describes it."""

    name: str
    addresses: tuple[str, ...]  # HOST:PORT of its control channel, one per advertised address
    models: tuple[str, ...]  # short identities (short_model_id) of the models it holds
    fingerprint: str  # of its cluster's public key, or NO_KEY
    proto: int  # wire PROTOCOL_VERSION it speaks
    ring_port: int
    instance: str = ""  # the DNS-SD service instance it was found as

    @property
    def address(self) -> str:
        """The first control address advertised."""
        return self.addresses[0] if self.addresses else ""

    def holds(self, identity: str) -> bool:
        return short_model_id(identity) in self.models

    def __str__(self) -> str:
        return f"{self.name} ({', '.join(self.addresses)})" if self.addresses else self.name


def encode_txt(name: str, ring_port: int, models: Iterable[str], keys: ClusterKeys | None) -> dict[str, str]:
    """A node's TXT properties. Every value fits a TXT string: a long name is cut, and models that do not fit
    are left out (the head learns the full list from the node's Welcome)."""
    room = TXT_VALUE_BYTES - len("models=")
    shown: list[str] = []
    for m in (short_model_id(m) for m in models):
        if len(",".join([*shown, m]).encode()) > room:
            break
        shown.append(m)
    return {"proto": str(PROTOCOL_VERSION), "name": _cut(name, TXT_VALUE_BYTES - len("name=")),
            "ring": str(ring_port), "models": ",".join(shown), "key": fingerprint(keys)}


def decode_txt(instance: str, addresses: Sequence[str], props: Mapping[bytes | str, bytes | str | None]) -> Found:
    """A Found from a service's TXT properties and its control addresses; ProtocolError when it is not a
    primaplug announcement."""
    text = {(k.decode(errors="replace") if isinstance(k, bytes) else k):
            (v.decode(errors="replace") if isinstance(v, bytes) else v or "") for k, v in props.items()}
    missing = [k for k in ("proto", "name", "ring", "key") if not text.get(k)]
    if missing:
        raise ProtocolError(f"the announcement {instance!r} lacks {', '.join(missing)}: not a primaplug node")
    try:
        proto, ring = int(text["proto"]), int(text["ring"])
    except ValueError:
        raise ProtocolError(f"the announcement {instance!r} has a malformed proto or ring port") from None
    models = tuple(m for m in text.get("models", "").split(",") if m)
    return Found(name=text["name"], addresses=tuple(addresses), models=models, fingerprint=text["key"],
                 proto=proto, ring_port=ring, instance=instance)


def in_order(found: Iterable[Found]) -> list[Found]:
    """A stable order for a ring made of nodes found: by name, then address."""
    return sorted(found, key=lambda f: (f.name, f.address))


def _cut(text: str, limit: int) -> str:
    data = text.encode()
    return text if len(data) <= limit else data[:limit].decode(errors="ignore")
