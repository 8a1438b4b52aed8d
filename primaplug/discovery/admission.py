"""Which nodes found a head may use: those of its own cluster (the same key fingerprint, the same protocol) that
prove they hold the cluster key. Pure rules plus a proof the caller injects, no network of its own.

The proof is `prove(address) -> bool`: the CLI passes one that sends a Hello over CurveZMQ with the cluster key
(head/nodes.py: NodeClient), in which the head checks the node's public key in the handshake, so a node without
the key's secret half never answers. Discovery is an inner layer: it takes the proof, it does not import the head.
A node without keys is used only on loopback, where there is no key to prove.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from primaplug.discovery.records import NO_KEY, Found, fingerprint, in_order
from primaplug.transport.addresses import is_loopback, split_address
from primaplug.transport.keys import ClusterKeys
from primaplug.wire import PROTOCOL_VERSION

log = logging.getLogger(__name__)

Prove = Callable[[str], bool]  # a node's control address -> whether it answered as a holder of the cluster key


def usable_addresses(found: Found, keys: ClusterKeys | None) -> tuple[str, ...]:
    """The addresses a head may try: all of them for a node with keys, only loopback ones for one without."""
    if keys is None:
        return tuple(a for a in found.addresses if is_loopback(split_address(a)[0]))
    return found.addresses


def refusal(found: Found, keys: ClusterKeys | None, model: str | None = None) -> str:
    """'' when the node belongs to this head's cluster (before any proof), else why not, saying what to do.

    `model`: the identity of the model the head runs; a node whose announcement lists others is skipped."""
    if found.proto != PROTOCOL_VERSION:
        older = "the node" if found.proto < PROTOCOL_VERSION else "this head"
        return f"node {found} speaks protocol {found.proto}, this head {PROTOCOL_VERSION}: upgrade {older}"
    mine = fingerprint(keys)
    if found.fingerprint != mine:
        if keys is None:
            return f"node {found} holds a cluster key and this head none: start the head with the same --keys file"
        if found.fingerprint == NO_KEY:
            return f"node {found} has no cluster key: start it with the same --keys file as this head"
        return f"node {found} advertises another cluster key: start it with the same --keys file"
    if not usable_addresses(found, keys):
        return (f"node {found} has no cluster key and is not on this machine's loopback: a node off loopback "
                "needs --keys (the same file on every device and the head)")
    if model is not None and found.models and not found.holds(model):
        return (f"node {found} does not hold this model (it holds {', '.join(found.models)}): start it with -m "
                "and this model's file")
    return ""


def admit(found: Found, keys: ClusterKeys | None, prove: Prove | None) -> str | None:
    """The first address of a node of this cluster at which it proves it holds the key, or None.

    Without `prove`, only loopback addresses are used (off loopback nothing would be proven)."""
    for address in usable_addresses(found, keys):
        if prove is not None:
            if prove(address):
                return address
        elif is_loopback(split_address(address)[0]):
            return address
    return None


def keep_proven(found: Iterable[Found], keys: ClusterKeys | None, prove: Prove | None, *,
                model: str | None = None) -> tuple[list[tuple[Found, str]], list[tuple[Found, str]]]:
    """The nodes of this cluster that prove they hold its key, with the address each proved itself at, in a stable
    order (name, then address); and those skipped, each with why. Proofs run at once (a failing one takes its
    whole timeout)."""
    found = in_order(found)
    skipped: list[tuple[Found, str]] = [(f, why) for f in found if (why := refusal(f, keys, model))]
    left = [f for f in found if not refusal(f, keys, model)]
    with ThreadPoolExecutor(max(1, min(16, len(left)))) as pool:
        proven = list(pool.map(lambda f: admit(f, keys, prove), left))
    kept: list[tuple[Found, str]] = []
    for f, address in zip(left, proven, strict=True):
        if address is None:
            skipped.append((f, unproven(f)))
        else:
            kept.append((f, address))
    return kept, skipped


def unproven(found: Found) -> str:
    return (f"node {found} did not prove it holds this cluster's key (no answer over CurveZMQ): start it with the "
            "same --keys file, or check that it is reachable")
