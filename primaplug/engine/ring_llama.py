"""A llama_cpp.Llama whose layers run elsewhere: the head's face to the user.

llama-cpp-python samples straight from a llama.cpp context's logits (`llama_sampler_sample(ctx, -1)`), so the
head keeps one real context: the output-only window [n_layer, n_layer), which turns the hidden states that come
back from the ring into logits. Everything above `eval` (tokenizer, chat templates, samplers, grammars,
logprobs, streaming, prefix reuse, the OpenAI-compatible server) is llama-cpp-python's own code, unchanged.

Llama.__init__ would load the whole model; while it runs, its `LlamaModel` and `LlamaContext` are swapped for
two wrappers over the head's windowed model and its output-only window (for this thread only).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import llama_cpp
import llama_cpp._internals as _internals
import llama_cpp.llama as _llama_module
import numpy as np

from primaplug.core.errors import PrimaplugError
from primaplug.engine.model import ContextSettings, Model, Window


class Session(Protocol):
    """The conversation on the ring: what the head's context hands its tokens and KV operations to
    (primaplug.head.Session fits)."""

    def eval(self, tokens: Sequence[int], pos0: int, *, all_rows: bool = False,
             output: Callable[[np.ndarray, int], None] | None = None) -> None: ...

    def rewind(self, pos: int) -> None: ...

    def clear(self) -> None: ...


_building = threading.local()
_swap_lock = threading.Lock()


class _HeadModel(_internals.LlamaModel):
    """llama-cpp-python's model wrapper over the head's windowed model, which it does not own."""

    def __init__(self, *, path_model: str, params: Any, verbose: bool = True) -> None:  # noqa: ARG002
        model: Model = _building.model
        self.path_model, self.params, self.verbose = path_model, params, verbose
        self._exit_stack = contextlib.ExitStack()
        self.sampler = None
        self.custom_samplers = []
        self.model = model._ptr
        self.vocab = model._vocab


class _HeadContext(_internals.LlamaContext):
    """llama-cpp-python's context wrapper over the output-only window; KV operations go to the session."""

    def __init__(self, *, model: Any, params: Any, verbose: bool = True) -> None:
        head: Model = _building.model
        settings = ContextSettings(n_ctx=params.n_ctx, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
                                   n_threads=params.n_threads, n_seq_max=params.n_seq_max)
        n = head.layout.n_layer
        self.window: Window = head.window(n, n, settings=settings)
        self.model, self.params, self.verbose = model, params, verbose
        self._exit_stack = contextlib.ExitStack()
        self.ctx = self.window._ctx
        self.session: Session = _building.session

    # the output-only window keeps no keys or values and forgets positions as it goes (Window.forward): the KV
    # cache that matters is the ring's, which the session owns
    def kv_cache_clear(self) -> None:
        self.session.clear()

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        if p1 >= 0:
            raise PrimaplugError(f"removing positions [{p0}, {p1}) from the middle of a conversation is not supported "
                                 "over a ring: only rewinding (removing every position from one on)")
        self.session.rewind(max(p0, 0))
        return True

    def kv_cache_seq_cp(self, *args: Any) -> None:
        raise PrimaplugError("copying KV cache sequences is not supported over a ring yet")

    def kv_cache_seq_keep(self, *args: Any) -> None:
        raise PrimaplugError("keeping one KV cache sequence is not supported over a ring yet")

    def kv_cache_seq_shift(self, *args: Any) -> None:
        raise PrimaplugError("shifting the KV cache is not supported over a ring yet")


class _Internals:
    """Stands in for llama_cpp._internals inside llama_cpp.llama while a RingLlama is built (this thread only)."""

    def __getattr__(self, name: str) -> Any:
        if getattr(_building, "model", None) is not None:
            if name == "LlamaModel":
                return _HeadModel
            if name == "LlamaContext":
                return _HeadContext
        return getattr(_internals, name)


@contextlib.contextmanager
def _head_parts(model: Model, session: Session) -> Iterator[None]:
    with _swap_lock:
        _building.model, _building.session = model, session
        _llama_module.internals = _Internals()  # type: ignore[assignment]
        try:
            yield
        finally:
            _llama_module.internals = _internals
            _building.model = _building.session = None


class RingLlama(llama_cpp.Llama):
    """llama_cpp.Llama over a ring: `head` is the head's windowed model (vocabulary and output layer), `session`
    the conversation on the ring."""

    def __init__(self, head: Model, session: Session, **kwargs: Any) -> None:
        if not head.output:
            raise PrimaplugError("the head's model must be loaded with output=True: the head runs the output layer")
        for unsupported in ("draft_model", "lora_path", "embedding"):
            if kwargs.get(unsupported):
                raise PrimaplugError(f"{unsupported} is not supported over a ring yet")
        self._head, self._session = head, session
        kwargs.setdefault("flash_attn", False)
        with _head_parts(head, session):
            super().__init__(head.path, **kwargs)
        self._out: Window = self._ctx.window  # type: ignore[attr-defined]

    def eval(self, tokens: Sequence[int]) -> None:
        """Run tokens through the ring from position n_tokens (the session rewinds its prefix to there first); the
        logits land in the head's context, where llama-cpp-python's sampler reads them."""
        n_past, n = self.n_tokens, len(tokens)
        if n_past + n > len(self.input_ids):  # the n_ctx asked for (llama.cpp pads its own to a multiple of 256)
            # llama-cpp-python's own words for it (Llama.create_completion), so callers see one error either way
            raise ValueError(f"Requested tokens ({n_past + n}) exceed context window of {len(self.input_ids)}")
        mode = "all" if self._logits_all else "keep"  # "keep": the sampler reads them in llama.cpp's buffer

        def output(hidden: np.ndarray, pos: int) -> None:
            logits = self._out.forward(hidden, pos, logits=mode)
            if self._logits_all:
                self.scores[pos : pos + len(logits), :] = logits

        self._session.eval(list(tokens), n_past, all_rows=self._logits_all, output=output)
        self.input_ids[n_past : n_past + n] = tokens
        self.n_tokens += n
        self._requires_eval = False

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        raise PrimaplugError("embeddings are not supported over a ring")

    def save_state(self) -> Any:
        raise PrimaplugError("saving state is not supported over a ring yet (the KV cache lives on the nodes)")

    def load_state(self, state: Any) -> None:
        raise PrimaplugError("loading state is not supported over a ring yet (the KV cache lives on the nodes)")
