"""Discovery: nodes announce themselves on the local network by mDNS/DNS-SD, and a head finds the ones of its
cluster, without addresses typed in (docs/discovery.md).

    records.py    what an announcement holds (TXT properties, no secret), Found, the key fingerprint: pure
    admission.py  which nodes found a head may use: same cluster, and proven by a Hello over CurveZMQ (injected)
    mdns.py       Advertiser (a node's `--advertise`), Browser and discover() (`--nodes auto`, the dashboard):
                  the only importer of zeroconf, loaded on first use (PEP 562)

`Browser.addresses()` answers "which nodes of this cluster are there now" at any moment, for a head that adds
nodes which join later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from primaplug.discovery.admission import Prove, admit, keep_proven, refusal, usable_addresses
from primaplug.discovery.records import NO_KEY, SERVICE_TYPE, Found, decode_txt, encode_txt, fingerprint, in_order

if TYPE_CHECKING:
    from primaplug.discovery.mdns import Advertiser, Browser, discover, self_test

__all__ = ["NO_KEY", "SERVICE_TYPE", "Advertiser", "Browser", "Found", "Prove", "admit", "decode_txt", "discover",
           "encode_txt", "fingerprint", "in_order", "keep_proven", "refusal", "self_test", "usable_addresses"]


def __getattr__(name: str) -> Any:
    if name in ("Advertiser", "Browser", "discover", "self_test"):
        from primaplug.discovery import mdns

        return getattr(mdns, name)
    raise AttributeError(f"module 'primaplug.discovery' has no attribute {name!r}")
