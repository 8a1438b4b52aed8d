"""Nodes without the model's file (primaplug/store, docs/distribute.md): pieces, manifests, fetching, checking,
resuming and the disk budget, over real sockets; and real nodes that fetch their windows and give plain's tokens."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from primaplug.core.errors import ConfigError, ProtocolError
from primaplug.engine import read_layout
from primaplug.store import (
    PIECE_BYTES,
    Fetcher,
    FetchError,
    HolderService,
    Store,
    file_manifest,
    needed_pieces,
    piece_plan,
)
from primaplug.store.copy import DiskBudgetError
from primaplug.store.holder import WholeFile, answer
from primaplug.store.manifest import HEADER, check_identity, header_pieces, needed_units
from primaplug.transport import ZmqTransport
from primaplug.transport.keys import generate_keys
from primaplug.wire import ErrorReply, FileSource, GetManifest, PieceData, ReadPiece, decode_request, encode

MiB = 2**20
ROOM = 1024 * MiB  # a model folder's room where the test is not about it: the disk's free space does not matter


@pytest.fixture
def transport() -> Iterator[ZmqTransport]:
    t = ZmqTransport(None)
    yield t
    t.close()


@pytest.fixture
def served(streaming_model: Path, transport: ZmqTransport, tmp_path: Path
           ) -> Iterator[tuple[HolderService, FileSource]]:
    layout = read_layout(streaming_model)
    holder = HolderService(transport, "127.0.0.1", streaming_model,
                           file_manifest(streaming_model, layout, cache_dir=tmp_path / "manifests"))
    yield holder, FileSource(holders=(holder.address,), manifest_sha256=holder.file.manifest.digest())
    holder.close()


def _copy(store: Store, fetcher: Fetcher):  # the node's first steps: the manifest, then the header
    copy = store.copy(fetcher.manifest(), "model.gguf")
    fetcher.fetch(copy, header_pieces(copy.manifest))
    return copy, copy.layout()


def test_the_pieces_cover_the_file_and_follow_the_units(streaming_model: Path) -> None:
    layout = read_layout(streaming_model)
    pieces = piece_plan(layout)
    assert pieces[0].offset == 0 and sum(p.length for p in pieces) == layout.file_size
    assert all(a.offset + a.length == b.offset for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(0 < p.length <= PIECE_BYTES for p in pieces)
    assert sum(p.length for p in pieces if p.unit == HEADER) == layout.data_offset
    # a window's pieces are its layers' tensors and the padding after them, and nothing of another layer
    need = [pieces[i] for i in needed_pieces(layout, [2, 3])]
    tensors = sum(layout.layer_bytes(il) for il in (2, 3))
    assert {HEADER, "blk.2", "blk.3"} <= {p.unit for p in need} <= needed_units(layout, [2, 3])
    assert needed_units(layout, [2, 3]) == {HEADER, "globals", "blk.2", "blk.3"}
    layer_bytes = sum(p.length for p in need if p.unit.startswith("blk."))
    assert tensors <= layer_bytes <= tensors * 1.001
    # the first window looks tokens up, but their rows come with them (head/embedding.py); a tied lm_head reads it all
    assert "input" not in needed_units(layout, [0])
    assert ("input" in needed_units(layout, [0], output=True)) == layout.output_tied


def test_a_node_fetches_exactly_its_pieces_and_they_are_the_files(streaming_model: Path, tmp_path: Path,
                                                                   transport: ZmqTransport, served) -> None:
    holder, source = served
    layout = read_layout(streaming_model)
    store = Store(tmp_path / "models", ROOM)
    fetcher = Fetcher(transport, source, layout.identity)
    copy, fetched = _copy(store, fetcher)
    assert fetched.identity == layout.identity
    need = needed_pieces(fetched, [2, 3, 4])
    got = fetcher.fetch(copy, need)
    want = copy.bytes_of(need)
    assert copy.held_bytes == want
    assert got + copy.bytes_of(header_pieces(copy.manifest)) == want
    assert fetcher.bytes_received <= 1.01 * want  # the messages' own bytes are a few per 4 MiB
    assert copy.disk_bytes() <= want + len(need) * 4096  # holes elsewhere: at most a block more a piece
    with open(streaming_model, "rb") as f:
        for i in need:
            o, n = copy.manifest.offsets[i], copy.manifest.lengths[i]
            assert os.pread(copy.fd, n, o) == os.pread(f.fileno(), n, o)
    assert holder.served_bytes == want
    assert fetcher.fetch(copy, need) == 0  # held: nothing asked again


def test_the_first_node_takes_the_embedding_rows_its_tokens_bring(streaming_model: Path, tmp_path: Path,
                                                                   transport: ZmqTransport, served) -> None:
    """A node without the token embedding holds the rows the head sent, where the file has them, and says which
    tokens it still lacks, rather than looking them up in a hole (zeros)."""
    _, source = served
    layout = read_layout(streaming_model)
    store = Store(tmp_path / "node", ROOM)
    copy, _ = _copy(store, Fetcher(transport, source, layout.identity))
    embd = layout.tensor("token_embd.weight")
    row = embd.nbytes // embd.shape[1]
    with open(streaming_model, "rb") as f:
        def file_row(i: int) -> bytes:
            f.seek(embd.offset + i * row)
            return f.read(row)

        assert copy.lacks_rows([3, 1, 3]) == [1, 3]
        copy.write_rows([3], file_row(3))
        assert copy.lacks_rows([3, 1]) == [1]
        assert os.pread(copy.fd, row, embd.offset + 3 * row) == file_row(3)
        with pytest.raises(ProtocolError, match="bytes of embedding rows"):
            copy.write_rows([1, 2], file_row(1))
        with pytest.raises(ProtocolError, match="its tokens 0"):
            copy.write_rows([embd.shape[1]], file_row(1))
    store.close()


def test_a_cut_off_fetch_resumes_where_it_stopped(streaming_model: Path, tmp_path: Path, transport: ZmqTransport,
                                                  served) -> None:
    _, source = served
    model = read_layout(streaming_model).identity
    store = Store(tmp_path / "models", ROOM)
    copy, layout = _copy(store, Fetcher(transport, source, model))
    need = needed_pieces(layout, range(layout.n_layer))
    calls = []
    cut = Fetcher(transport, source, model, stop=lambda: len(calls) > 5)
    with pytest.raises(FetchError, match="stopped"):
        cut.fetch(copy, need, progress=calls.append)
    held = dict(copy.held)
    assert 0 < len(held) < len(need)
    store.close()
    again = Store(tmp_path / "models", ROOM)  # a node restarted: the record says what its copy holds
    copy = again.copies[model]
    assert copy.held.keys() == held.keys()
    rest = Fetcher(transport, source, model)
    assert rest.fetch(copy, need) == copy.bytes_of(need) - copy.bytes_of(held)
    assert copy.verify(need) == []


def test_a_corrupted_piece_is_found_and_fetched_again(streaming_model: Path, tmp_path: Path, transport: ZmqTransport,
                                                      served) -> None:
    _, source = served
    model = read_layout(streaming_model).identity
    store = Store(tmp_path / "models", ROOM)
    fetcher = Fetcher(transport, source, model)
    copy, layout = _copy(store, fetcher)
    need = needed_pieces(layout, [5])
    fetcher.fetch(copy, need)
    victim = need[-1]
    at = copy.manifest.offsets[victim] + 100
    with open(copy.path, "r+b") as f:  # a flipped byte on the node's disk, by another hand
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    assert copy.verify(need) == [victim]
    assert copy.missing(need) == [victim]
    assert fetcher.fetch(copy, need) == copy.manifest.lengths[victim]
    assert hashlib.sha256(copy.read(victim)).digest() == copy.manifest.piece_sha256(victim)


class _Liar:
    """A holder that flips a byte of every piece it serves (or sends a manifest of its own)."""

    def __init__(self, transport: ZmqTransport, honest: HolderService, *, manifest: bool = False) -> None:
        self.server = transport.control_server("127.0.0.1", 0)
        self.address, self.honest, self.manifest = self.server.address, honest, manifest
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            got = self.server.recv(0.1)
            if got is None:
                continue
            req = decode_request(got[1])
            reply = answer(req, "liar", lambda m: self.honest.file)  # type: ignore[arg-type]
            if isinstance(reply, PieceData):
                reply = msgspec.structs.replace(reply, data=bytes([reply.data[0] ^ 1]) + reply.data[1:])
            elif self.manifest:
                reply = msgspec.structs.replace(reply, sha256=bytes(len(reply.sha256)))  # type: ignore[type-var]
            self.server.reply(got[0], encode(reply))
        self.server.close()


def test_a_holder_that_lies_is_dropped_and_the_next_one_serves(streaming_model: Path, tmp_path: Path,
                                                                transport: ZmqTransport, served) -> None:
    honest, source = served
    model = read_layout(streaming_model).identity
    liar, fake = _Liar(transport, honest), _Liar(transport, honest, manifest=True)
    try:
        # a manifest other than the head's is refused at once; the lying pieces fail their hashes
        fetcher = Fetcher(transport, FileSource((fake.address, liar.address, source.holders[0]),
                                                source.manifest_sha256), model)
        store = Store(tmp_path / "models", ROOM)
        copy, layout = _copy(store, fetcher)
        assert "manifest other than the head's" in fetcher.dropped[fake.address]
        assert "do not match their hash" in fetcher.dropped[liar.address]
        need = needed_pieces(layout, [1])
        fetcher.fetch(copy, need)
        assert copy.verify(need) == []
        # alone, the liar gets a clear error, and nothing it sent is kept
        lone = Fetcher(transport, FileSource((liar.address,), source.manifest_sha256), model)
        more = needed_pieces(layout, [6])
        with pytest.raises(FetchError, match="do not match their hash"):
            lone.fetch(copy, more)
        assert copy.missing(more) == [i for i in more if i not in header_pieces(copy.manifest)]
    finally:
        for h in (liar, fake):
            h.stop.set()
            h.thread.join()


def test_the_disk_budget_drops_the_least_recently_used_layers(streaming_model: Path, tmp_path: Path,
                                                               transport: ZmqTransport, served) -> None:
    _, source = served
    model = read_layout(streaming_model).identity
    layout = read_layout(streaming_model)
    probe = Store(tmp_path / "probe", ROOM)
    header = probe.copy(file_manifest(streaming_model, layout, cache_dir=tmp_path / "m"), "m.gguf").bytes_of(
        needed_pieces(layout, []))
    room = header + sum(layout.layer_bytes(il) for il in range(3)) + MiB  # three layers and a little
    store = Store(tmp_path / "models", budget_bytes=room)
    fetcher = Fetcher(transport, source, model)
    copy, layout = _copy(store, fetcher)
    first, second = needed_pieces(layout, [1, 2]), needed_pieces(layout, [3, 4])
    store.make_room(copy, first, {})
    fetcher.fetch(copy, first)
    copy.touch(first)
    store.make_room(copy, second, {model: set()})  # layers 1 and 2 are not in use any more
    fetcher.fetch(copy, second)
    assert store.held_bytes <= room
    assert not copy.missing(second) and copy.missing(first)
    assert copy.disk_bytes() <= store.held_bytes + len(copy.held) * 4096  # their bytes went back to the disk
    with pytest.raises(DiskBudgetError, match="raise --disk-budget"):
        store.make_room(copy, needed_pieces(layout, range(layout.n_layer)), {})


def test_a_holder_serves_models_by_identity_only(streaming_model: Path, tmp_path: Path, served) -> None:
    honest, _ = served
    model = honest.file.manifest.model
    wrong = answer(ReadPiece(model="1:" + "0" * 32, index=0), "h", lambda m: None)
    assert isinstance(wrong, ErrorReply) and wrong.code == "wrong_model"
    far = answer(ReadPiece(model=model, index=10**9), "h", lambda m: honest.file)
    assert isinstance(far, ErrorReply) and far.code == "bad_request"
    assert answer(GetManifest(model=model), "h", lambda m: honest.file) == honest.file.manifest
    store = Store(tmp_path / "models", ROOM)
    copy = store.copy(honest.file.manifest, "m.gguf")  # an empty copy: a node that holds nothing yet
    lacks = answer(ReadPiece(model=model, index=3), "node", store.copies.get)
    assert isinstance(lacks, ErrorReply) and lacks.code == "missing"
    for bad in ("../../etc/passwd", "1:../x", "12:" + "A" * 32, "x" * 200):
        with pytest.raises(ConfigError, match="not a model identity"):
            check_identity(bad)
    with pytest.raises(Exception, match="size changed"):
        WholeFile(copy.path.with_suffix(".pieces"), honest.file.manifest)
    assert list(store.folder.iterdir()) and all(p.parent == store.folder for p in store.folder.iterdir())


def test_fetching_over_curve_keys(streaming_model: Path, tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "cluster.key")
    layout = read_layout(streaming_model)
    secure = ZmqTransport(keys)
    holder = HolderService(secure, "127.0.0.1", streaming_model, file_manifest(streaming_model, layout,
                                                                                cache_dir=tmp_path / "m"))
    try:
        source = FileSource((holder.address,), holder.file.manifest.digest())
        copy, fetched = _copy(Store(tmp_path / "models", ROOM), Fetcher(secure, source, layout.identity))
        assert fetched.identity == layout.identity
        outsider = ZmqTransport(generate_keys(tmp_path / "other.key"))  # another cluster's key: never answered
        try:
            with pytest.raises(FetchError, match="did not answer"):
                Fetcher(outsider, source, layout.identity, timeout_s=1.0).manifest()
        finally:
            outsider.close()
    finally:
        holder.close()
        secure.close()


@pytest.mark.multiproc
def test_nodes_without_the_file_fetch_their_windows_and_give_plains_tokens(gemma_path: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """...keep their layers once, repacked in place (no repacked copy beside them), and still hand out the file's
    bytes."""
    import llama_cpp

    import primaplug
    from primaplug.head.launch import LocalNodes

    prompt, kwargs = "The capital of France is", {"n_ctx": 256, "verbose": False}
    layout = read_layout(gemma_path)
    pieces = piece_plan(layout)

    def size(layers: range) -> int:
        return sum(pieces[i].length for i in needed_pieces(layout, layers))

    folders = [tmp_path / "d1", tmp_path / "d2"]
    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))  # where a repacked copy would go
    with LocalNodes([None, None], 2, log_dir=tmp_path / "logs",
                    node_args=[["--model-dir", str(f), "--disk-budget", "1024"] for f in folders]) as nodes:
        llm = primaplug.Llama(str(gemma_path), nodes=nodes.addresses, layers=[6, 6, 6], scheduler="even", **kwargs)
        try:
            text = llm(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
            first = [n.status().fetched_bytes for n in llm._cluster.nodes]
        finally:
            llm.close()
        # each node fetched exactly its windows' pieces, and its disk holds about that: the first node, no token
        # embedding (its tokens bring their rows), so well under the whole file
        assert first == [size(range(0, 6)), size(range(6, 12))]
        assert first[0] < layout.file_size / 4
        for folder, want in zip(folders, first, strict=True):
            (copy,) = folder.glob("*.gguf")
            assert copy.stat().st_size == layout.file_size
            assert copy.stat().st_blocks * 512 <= want * 1.01
        # another split: only the layers that moved come over
        llm = primaplug.Llama(str(gemma_path), nodes=nodes.addresses, layers=[3, 9, 6], scheduler="even", **kwargs)
        try:
            again = llm(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
            second = [n.status().fetched_bytes for n in llm._cluster.nodes]
            # what the nodes said they held when the head connected, against the new windows: the plan's figure
            lacked = llm._cluster.missing_bytes()
        finally:
            llm.close()
        moved = size(range(3, 6)) - size(range(0, 0))  # layers 3-5, without the header node 2 holds already
        assert second == [first[0], first[1] + moved]
        assert list(lacked.values()) == [0, moved]
    for folder in folders:
        store = Store(folder, ROOM)
        (copy,) = store.copies.values()
        assert not list((tmp_path / "cache").glob(f"repacked/{copy.path.stem}*"))  # the head's own copy only
        assert copy.forms and any(copy.forms.values())  # this CPU repacks some of Gemma's weights, in the copy
        assert copy.verify(list(copy.held)) == []  # read back as the file's bytes, every piece
        # a layer that loses a piece (the disk budget, a failed check) is put back as the file has it
        unit = next(u for u, tensors in copy.forms.items() if tensors)
        plan = piece_plan(copy.layout())
        mine = [i for i in copy.held if plan[i].unit == unit]
        copy.drop(mine[:1])
        assert unit not in copy.forms
        store.close()
        store = Store(folder, ROOM)
        (copy,) = store.copies.values()
        assert copy.verify(mine[1:]) == [] and not copy.missing(mine[1:])
        # a layer repacked under a layout this engine does not undo (another engine or CPU) is fetched again
        other = next(u for u, tensors in copy.forms.items() if tensors)
        copy.forms[other] = dict.fromkeys(copy.forms[other], "0" * 16)
        copy.save()
        store.close()
        store = Store(folder, ROOM)
        (copy,) = store.copies.values()
        copy.layout()
        theirs = [i for i, p in enumerate(copy.pieces()) if p.unit == other]
        assert other not in copy.forms and copy.missing(theirs) == theirs
        store.close()
    plain = llama_cpp.Llama(str(gemma_path), **kwargs)
    want = plain(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    assert text == want and again == want


def test_a_node_given_only_its_address_fetches_into_primaplugs_cache(gemma_path: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`primaplug node` needs no model and no folder: it keeps what heads send in models/ of primaplug's cache,
    within its disk's free space, and says so, with how to change either; the ring gives plain's tokens."""
    import llama_cpp

    import primaplug
    from primaplug.head.launch import LocalNodes

    monkeypatch.setenv("PRIMAPLUG_CACHE", str(tmp_path / "cache"))  # an empty cache, inherited by the node
    prompt, kwargs = "The capital of France is", {"n_ctx": 256, "verbose": False}
    with LocalNodes([None], 1, log_dir=tmp_path / "logs") as nodes:
        llm = primaplug.Llama(str(gemma_path), nodes=nodes.addresses, layers=[9, 9], scheduler="even", **kwargs)
        try:
            text = llm(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]
        finally:
            llm.close()
        said = nodes.nodes[0].log()
    folder = (tmp_path / "cache" / "models").resolve()
    assert f"layers that heads send go to {folder} (--model-dir DIR)" in said, said
    assert "GiB of its disk (--disk-budget MiB)" in said and "loopback only" in said
    (copy,) = folder.glob("*.gguf")
    assert 0 < copy.stat().st_blocks * 512 < read_layout(gemma_path).file_size
    plain = llama_cpp.Llama(str(gemma_path), **kwargs)
    assert text == plain(prompt, max_tokens=16, temperature=0)["choices"][0]["text"]


def test_the_plan_adds_the_slowest_fetch_to_the_first_token() -> None:
    from primaplug.scheduler import Fetch
    from primaplug.scheduler.plan import describe_fetches

    line = describe_fetches((Fetch("phone", 400 * MiB, 40e6), Fetch("desk", 100 * MiB, 60e6), Fetch("mac", 0, 50e6)))
    assert line.startswith("before the first token: 10.5 s more") and "phone 400 MiB, desk 100 MiB;" in line
    assert "phone the slowest, at 40.0 MB/s" in line and "mac" not in line
    assert describe_fetches((Fetch("mac", 0, 50e6),)) == ""


def test_a_model_folder_is_one_nodes(tmp_path: Path) -> None:
    store = Store(tmp_path / "models", ROOM)
    with pytest.raises(ConfigError, match="another node uses"):
        Store(tmp_path / "models", ROOM)
    store.close()
    Store(tmp_path / "models", ROOM).close()  # free again once the first has gone


def test_a_node_serves_what_its_copy_holds_to_another(streaming_model: Path, tmp_path: Path,
                                                      transport: ZmqTransport, served) -> None:
    """A peer with a copy is a holder too: it serves the pieces it holds and says which it lacks."""
    _, source = served
    model = read_layout(streaming_model).identity
    first = Store(tmp_path / "a", ROOM)
    fetcher = Fetcher(transport, source, model)
    copy, layout = _copy(first, fetcher)
    fetcher.fetch(copy, needed_pieces(layout, [1, 2]))
    server = transport.control_server("127.0.0.1", 0)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if (got := server.recv(0.1)) is not None:
                server.reply(got[0], encode(answer(decode_request(got[1]), "peer", first.copies.get)))
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        peer = Fetcher(transport, FileSource((server.address,), source.manifest_sha256), model)
        second = Store(tmp_path / "b", ROOM)
        other, _ = _copy(second, peer)
        need = needed_pieces(layout, [1, 2])
        peer.fetch(other, need)
        assert other.verify(need) == [] and not other.missing(need)
        with pytest.raises(FetchError, match=r"lacks \d+ of them"):
            peer.fetch(other, needed_pieces(layout, [3]))
    finally:
        stop.set()
        thread.join()


@pytest.mark.multiproc
def test_run_with_local_nodes_that_fetch(tmp_path: Path) -> None:
    """`run --local-nodes 2 --local-fetch --verify`: nodes without the file, plain's tokens and logits, and their
    model folders removed after."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    got = subprocess.run([sys.executable, "-m", "primaplug", "run", "--local-nodes", "2", "--local-fetch",
                          "--scheduler", "even", "--temp", "0", "-n", "8", "-p", "The sky is", "--verify"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "gave the same 8 tokens, and the same logits for each" in got.stderr
    assert "to the nodes that fetch it" in got.stderr and "fetching" in got.stderr
    assert not list(tmp_path.glob("primaplug-models-*"))


def test_a_node_needs_a_model_or_a_folder(tmp_path: Path) -> None:
    from primaplug.node import NodeSettings

    with pytest.raises(ConfigError, match="--model FILE, or --model-dir DIR"):
        NodeSettings(models=()).check()
    with pytest.raises(ConfigError, match="--disk-budget is the room of the model folder: give --model-dir"):
        NodeSettings(models=(tmp_path / "model.gguf",), disk_budget_bytes=2**30).check()
    for size in (-1, 0):  # a folder with no room could fetch nothing
        with pytest.raises(ConfigError, match="a size of 1 MiB or more"):
            NodeSettings(models=(), model_dir=tmp_path, disk_budget_bytes=size).check()


def test_the_default_budget_is_the_free_disk_less_a_margin_and_a_full_disk_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --disk-budget a folder may take what its disk has free at start, less 1 GiB, plus what its copies
    hold already. A disk with less than that free is named at start, with the fix, not taken as "no folder"."""
    import shutil

    free = {"bytes": 3 * 2**30}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"]))
    store = Store(tmp_path / "models")
    assert store.budget_bytes == 2 * 2**30
    store.close()
    free["bytes"] = 613 * MiB
    with pytest.raises(ConfigError, match=r"has 613 MiB free, and a node leaves 1024 MiB of it free by default: "
                                          r"free some space, or give the folder's room with --disk-budget MiB"):
        Store(tmp_path / "models")
    Store(tmp_path / "models", ROOM).close()  # the lock was let go; a budget given needs no free disk


def test_a_node_that_cannot_fetch_is_refused_with_the_fix(streaming_model: Path, tmp_path: Path) -> None:
    """A node with a folder asked for a model without a source (an older head) says to upgrade the head; a head
    that does not hold the file (none to serve) is told to start the node with --model or --model-dir."""
    from primaplug.core.errors import NodeError
    from primaplug.head import Cluster, ClusterSettings, NodeClient
    from primaplug.wire import Assignment, GetProfile, ModelIdentity, WindowSpec, decode_reply
    from tests.inproc_nodes import InprocNodes

    layout = read_layout(streaming_model)
    ident = ModelIdentity.of(layout, streaming_model.name)
    with InprocNodes([], 1, model_dir=tmp_path / "models", disk_budget_bytes=ROOM) as nodes:
        head = nodes.head_transport()
        client = NodeClient(head, nodes.addresses[0])
        assert client.hello().device.disk_budget_bytes > 0
        a = Assignment(epoch=1, model=ident, windows=(WindowSpec(0, 2),), successor="tcp://127.0.0.1:9", n_ctx=64,
                       n_batch=32, n_ubatch=32)
        with pytest.raises(NodeError, match="gave no holder to fetch it from: upgrade the head") as e:
            client.load(a)
        assert e.value.code == "wrong_model"
        reply = decode_reply(client.client.request(encode(GetProfile(model=layout.identity)), 5.0))
        assert isinstance(reply, ErrorReply) and "upgrade the head" in reply.message
        client.close()
        cluster = Cluster(head, ClusterSettings(nodes=tuple(nodes.addresses)), ident)  # no layout: no file to serve
        try:
            with pytest.raises(NodeError, match="or with --model-dir to fetch the layers it runs from the head"):
                cluster.connect()
        finally:
            cluster.close()


def test_a_copy_is_read_through_its_descriptor_as_a_held_file_is(served, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's readers open the file the store holds, on Android (sys.platform "android") as on Linux."""
    import sys

    honest, _ = served
    for name, by_fd in (("android", True), ("darwin", False)):
        monkeypatch.setattr(sys, "platform", name)
        store = Store(tmp_path / name, ROOM)
        try:
            copy = store.copy(honest.file.manifest, "m.gguf")
            assert copy.reader_path == (f"/proc/self/fd/{copy.fd}" if by_fd else str(copy.path)), name
        finally:
            store.close()
