"""A local HTTP server standing in for the Hugging Face Hub (there is no network here): one repository's files,
served as huggingface_hub asks for them (HEAD and GET on /ORG/REPO/resolve/REV/FILE, with ranges; the file list on
/api/models/ORG/REPO/tree/REV)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _handler(repo: str, folder: Path) -> type[http.server.BaseHTTPRequestHandler]:
    etags: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        requests: list[str] = []

        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> Path | None:
            prefix = f"/{repo}/resolve/"
            if not self.path.startswith(prefix):
                return None
            name = self.path[len(prefix):].split("?")[0].split("/", 1)[-1]
            f = folder / name
            return f if f.is_file() and f.resolve().parent == folder.resolve() else None

        def _head(self, f: Path, length: int, status: int = 200, extra: dict[str, str] | None = None) -> None:
            if f.name not in etags:
                etags[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
            self.send_response(status)
            for k, v in {"Content-Length": str(length), "ETag": f'"{etags[f.name]}"', "X-Repo-Commit": COMMIT,
                         "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **(extra or {})}.items():
                self.send_header(k, v)
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802
            Handler.requests.append(f"HEAD {self.path}")
            f = self._file()
            if f is None:
                self.send_error(404)
                return
            self._head(f, f.stat().st_size)

        def do_GET(self) -> None:  # noqa: N802
            Handler.requests.append(f"GET {self.path} {self.headers.get('Range', '')}")
            if self.path.startswith(f"/api/models/{repo}/tree/"):
                body = json.dumps([{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": "0" * 40}
                                   for p in sorted(folder.iterdir()) if p.is_file()]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            f = self._file()
            if f is None:
                self.send_error(404)
                return
            size, start = f.stat().st_size, 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                start = int(rng[6:].split("-")[0] or 0)
                self._head(f, size - start, 206, {"Content-Range": f"bytes {start}-{size - 1}/{size}"})
            else:
                self._head(f, size)
            with open(f, "rb") as src:
                src.seek(start)
                while chunk := src.read(1 << 20):
                    self.wfile.write(chunk)

    return Handler


@contextmanager
def fake_hub(repo: str, folder: Path) -> Iterator[tuple[str, type[http.server.BaseHTTPRequestHandler]]]:
    """(the endpoint, for HF_ENDPOINT; the handler class, whose `requests` lists what was asked)."""
    handler = _handler(repo, folder)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
