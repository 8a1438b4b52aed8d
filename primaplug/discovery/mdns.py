"""mDNS/DNS-SD over python-zeroconf: a node announces itself (Advertiser), a head finds the nodes of its cluster
(Browser, discover). The only module of primaplug that imports zeroconf.

IPv4 only. A node on loopback announces its loopback address on the loopback interface only (one machine, and the
tests); a node bound to one address announces that address on that interface; one bound to every interface
(0.0.0.0) announces the address of each interface but loopback, on all of them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import ifaddr
from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceInfo, Zeroconf

from primaplug.core.errors import ConfigError, ProtocolError
from primaplug.core.settings import ADVERTISE_TTL_S, DISCOVER_S, PROVE_RETRY_S, PROVE_TIMEOUT_S
from primaplug.discovery.admission import Prove, admit, refusal, unproven
from primaplug.discovery.records import SERVICE_TYPE, Found, decode_txt, encode_txt, in_order
from primaplug.transport.addresses import WILDCARD_HOSTS
from primaplug.transport.keys import ClusterKeys

log = logging.getLogger(__name__)

RESOLVE_MS = 3000  # how long a browser waits for a service's SRV, TXT and address records once it saw its name
Change = Literal["added", "removed"]


def interface_addresses() -> list[str]:
    """This machine's IPv4 interface addresses, loopback left out."""
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback:
                out.append(ip.ip)
    return out


def advertised_addresses(host: str) -> tuple[list[str], list[str] | InterfaceChoice]:
    """For a node listening on `host`: the addresses it announces and the interfaces it announces them on."""
    if host in WILDCARD_HOSTS:
        found = interface_addresses()
        if not found:
            raise ConfigError("no network interface with an IPv4 address to advertise on: connect to a network, "
                              "or listen on 127.0.0.1")
        return found, InterfaceChoice.All
    try:
        address = "127.0.0.1" if host == "localhost" else str(ipaddress.IPv4Address(host))
    except ValueError:
        try:
            address = socket.gethostbyname(host)
        except OSError:
            raise ConfigError(f"cannot advertise {host}: --advertise works over IPv4; listen on an IPv4 address, a "
                              "name that resolves to one, or 0.0.0.0") from None
    return [address], [address]


def _label(text: str, limit: int = 63) -> str:
    """A DNS label from any text (instance and host names)."""
    return (re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-") or "node")[:limit]


class Advertiser:
    """Announces one node by mDNS/DNS-SD until closed (then says goodbye, so browsers drop it at once).

    Registering takes a second or two (mDNS probes the name first), so start() returns at once and registers in a
    thread; the node serves meanwhile. Two nodes of the same name on one network get distinct instance names
    (zeroconf renames the second)."""

    def __init__(self, *, name: str, host: str, port: int, ring_port: int, models: Iterable[str],
                 keys: ClusterKeys | None) -> None:
        addresses, self.interfaces = advertised_addresses(host)
        label = _label(f"{name}-{port}")
        self.info = ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port,
                                properties=encode_txt(name, ring_port, models, keys),
                                server=f"primaplug-{label}.local.", addresses=[socket.inet_aton(a) for a in addresses],
                                host_ttl=ADVERTISE_TTL_S, other_ttl=ADVERTISE_TTL_S)
        self.addresses = [f"{a}:{port}" for a in addresses]
        self._zc: Zeroconf | None = None
        self._thread: threading.Thread | None = None
        self._registered = threading.Event()
        self.error: Exception | None = None

    def start(self) -> Advertiser:
        self._zc = Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        self._thread = threading.Thread(target=self._register, name="advertise", daemon=True)
        self._thread.start()
        return self

    def _register(self) -> None:
        assert self._zc is not None
        try:
            self._zc.register_service(self.info, allow_name_change=True)
            self._registered.set()
            log.info("advertising %s at %s", self.info.name, ", ".join(self.addresses))
        except Exception as e:  # a thread boundary: the node serves on, unannounced, and says why
            self.error = e
            log.warning("could not advertise this node (%s: %s): heads must be given its address with --nodes",
                        type(e).__name__, e)

    def wait(self, timeout_s: float) -> bool:
        """Whether the announcement went out within timeout_s."""
        return self._registered.wait(timeout_s)

    def close(self) -> None:
        if self._zc is None:
            return
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if self._registered.is_set():
                self._zc.unregister_service(self.info)
        finally:
            self._zc.close()
            self._zc = None

    def __enter__(self) -> Advertiser:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Entry:
    found: Found
    state: Literal["proving", "used", "refused", "unproven"] = "proving"  # refused: not of this cluster
    address: str | None = None  # where it proved itself (state "used")
    why: str = ""  # why it is not used (refused, unproven)
    tried_at: float = 0.0  # time.monotonic() of its last proof


class Browser:
    """Finds the nodes that advertise themselves, and keeps the ones of this head's cluster that prove it.

    `prove(address) -> bool` checks a node holds the cluster key (admission.py); without it, only nodes on
    loopback are used. `interfaces`: the IPv4 addresses of the interfaces to browse on (default: all of them,
    loopback included). `model`: an identity; nodes that announce other models only are skipped. `on_change` is
    called ("added" | "removed", Found) from the browser's threads when a usable node appears or goes.

    `addresses()` is the head's "which nodes are there now": cheap (no network), for any thread, at any moment.
    """

    def __init__(self, keys: ClusterKeys | None = None, *, prove: Prove | None = None,
                 interfaces: Sequence[str] | None = None, model: str | None = None,
                 on_change: Callable[[Change, Found], None] | None = None) -> None:
        self.keys, self.prove, self.model, self.on_change = keys, prove, model, on_change
        self.interfaces: list[str] | InterfaceChoice = list(interfaces) if interfaces else InterfaceChoice.All
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._entries: dict[str, _Entry] = {}
        self._said: set[tuple[str, str]] = set()  # (instance, reason) already logged
        self._busy = 0  # resolutions and proofs under way
        self._cond = threading.Condition()

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> Browser:
        self._zc = Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, listener=self)
        return self

    def close(self) -> None:
        """Stop browsing; proofs under way are waited for (they use the caller's transport)."""
        if self._browser is not None:
            self._browser.cancel()
            self._browser = None
        self.settle()
        with self._cond:
            zc, self._zc = self._zc, None
        if zc is not None:
            zc.close()

    def __enter__(self) -> Browser:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def settle(self, timeout_s: float = PROVE_TIMEOUT_S + RESOLVE_MS / 1000) -> bool:
        """Wait until no announcement is being resolved or proven; False if some still are after timeout_s."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout_s)

    # --- what was found ----------------------------------------------------------------------------------------

    def nodes(self) -> list[Found]:
        """Every node advertised, of any cluster, in a stable order (name, then address)."""
        with self._cond:
            return in_order(e.found for e in self._entries.values())

    def usable(self) -> list[tuple[Found, str]]:
        """The nodes of this cluster that proved it, each with the control address it proved itself at."""
        self._retry_failed()
        with self._cond:
            return [(e.found, e.address) for e in in_order_entries(self._entries.values()) if e.address is not None]

    def addresses(self) -> list[str]:
        """The control addresses of the nodes of this cluster that proved it, in a stable order."""
        return [address for _, address in self.usable()]

    def refused(self) -> list[tuple[Found, str]]:
        """The nodes found but not used, each with why."""
        with self._cond:
            return [(e.found, e.why) for e in in_order_entries(self._entries.values()) if e.why]

    # --- zeroconf's listener (called in the ServiceBrowser's thread) -------------------------------------------

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._start(self._resolve, zc, type_, name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._start(self._resolve, zc, type_, name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        with self._cond:
            entry = self._entries.pop(name, None)
        if entry is not None and entry.address is not None:
            log.info("node %s is no longer advertised", entry.found)
            self._tell("removed", entry.found)

    def _start(self, job: Callable[..., None], *args: object) -> None:
        """Run a resolution or a proof in a thread of its own (counted until done): one slow node (a resolution
        waits up to RESOLVE_MS, a failing proof PROVE_TIMEOUT_S) never holds up the others."""
        with self._cond:
            if self._zc is None:
                return  # closed: nothing more is resolved or proven
            self._busy += 1
        threading.Thread(target=job, args=args, name=f"discovery {job.__name__}", daemon=True).start()

    def _resolve(self, zc: Zeroconf, type_: str, name: str) -> None:
        try:
            info = zc.get_service_info(type_, name, timeout=RESOLVE_MS)
            if info is None or info.port is None:
                log.debug("could not resolve the announcement %s", name)
                return
            addresses = [f"{a}:{info.port}" for a in info.parsed_addresses(IPVersion.V4Only)]
            try:
                found = decode_txt(name, addresses, info.properties)
            except ProtocolError as e:
                self._note(name, str(e))
                return
            why = refusal(found, self.keys, self.model)
            with self._cond:
                old = self._entries.get(name)
                if old is not None and old.found == found and old.state != "unproven":
                    return  # nothing new (zeroconf reports every refresh), or its proof is under way
                entry = self._entries[name] = _Entry(found, "refused" if why else "proving", why=why)
            if old is not None and old.address is not None:
                self._tell("removed", old.found)
            if why:
                self._note(name, why)
                return
            self._start(self._prove, name, entry)
        except Exception:  # a thread boundary: one odd announcement must not stop the browsing
            log.exception("could not take in the announcement %s", name)
        finally:
            self._done()

    def _prove(self, name: str, entry: _Entry) -> None:
        try:
            try:
                address = admit(entry.found, self.keys, self.prove)
            except Exception:  # a proof that breaks proves nothing; it is tried again later
                log.exception("proving %s", entry.found)
                address = None
            with self._cond:
                if self._entries.get(name) is not entry:
                    return  # replaced or removed meanwhile
                entry.address, entry.tried_at = address, time.monotonic()
                entry.state, entry.why = ("used", "") if address else ("unproven", unproven(entry.found))
            if address is None:
                self._note(name, entry.why)
            else:
                log.info("found node %s at %s", entry.found.name, address)
                self._tell("added", entry.found)
        finally:
            self._done()

    def _retry_failed(self) -> None:
        """Prove again, in the background, the nodes whose proof failed more than PROVE_RETRY_S ago (a node busy
        or briefly unreachable then)."""
        now = time.monotonic()
        with self._cond:
            if self._zc is None:
                return
            stale = [(n, e) for n, e in self._entries.items()
                     if e.state == "unproven" and now - e.tried_at > PROVE_RETRY_S]
            for _, e in stale:
                e.state = "proving"  # one retry at a time
        for name, entry in stale:
            self._start(self._prove, name, entry)

    def _done(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def _note(self, instance: str, why: str) -> None:
        """Log why a node is skipped, once per node and reason."""
        with self._cond:
            if (instance, why) in self._said:
                return
            self._said.add((instance, why))
        log.warning("%s", why)

    def _tell(self, change: Change, found: Found) -> None:
        if self.on_change is not None:
            try:
                self.on_change(change, found)
            except Exception:
                log.exception("the discovery callback failed")


def in_order_entries(entries: Iterable[_Entry]) -> list[_Entry]:
    return sorted(entries, key=lambda e: (e.found.name, e.address or e.found.address))


def discover(keys: ClusterKeys | None, timeout_s: float = DISCOVER_S, *, prove: Prove | None = None,
             interfaces: Sequence[str] | None = None, model: str | None = None) -> list[str]:
    """Browse for timeout_s and return the control addresses of the nodes of this cluster that proved it, in a
    stable order (name, then address); the others are logged with why they were skipped."""
    with Browser(keys, prove=prove, interfaces=interfaces, model=model) as browser:
        time.sleep(timeout_s)
        browser.settle()
        return browser.addresses()


def self_test(timeout_s: float = 3.0) -> tuple[bool, str]:
    """Whether this device sees its own mDNS announcement (`primaplug doctor`): a service registered on every
    interface, browsed for. (ok, the address it was announced at.)"""
    ip = "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet leaves: this only picks the interface a route would use
        ip = s.getsockname()[0]
    label = _label(f"doctor-{socket.gethostname()}-{os.getpid()}")
    info = ServiceInfo(SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=9, server=f"primaplug-{label}.local.",
                       addresses=[socket.inet_aton(ip)], properties={})
    seen = threading.Event()

    class Listener:
        def add_service(self, _zc: Zeroconf, _type: str, name: str) -> None:
            if name == info.name:
                seen.set()

        def update_service(self, _zc: Zeroconf, _type: str, name: str) -> None:
            self.add_service(_zc, _type, name)

        def remove_service(self, _zc: Zeroconf, _type: str, _name: str) -> None:
            pass

    zc = Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, listener=Listener())
        zc.register_service(info, allow_name_change=True)
        ok = seen.wait(timeout_s)
        browser.cancel()
        zc.unregister_service(info)
    finally:
        zc.close()
    return ok, ip
