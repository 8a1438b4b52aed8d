"""ctypes bindings of the layer-window API that patches/0001 and 0002 add to libllama.

Each binding sits under its C prototype from the patched llama.h, as in llama-cpp-python's own llama_cpp.py.
The patch adds functions only (no struct changes), so llama-cpp-python's struct mirrors stay valid.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Collection

import llama_cpp
from llama_cpp import llama_cpp as _ll

from primaplug.core.errors import EngineError

_lib = _ll._lib  # the libllama that llama-cpp-python loaded (honours LLAMA_CPP_LIB_PATH)

_SO_PREFIX = "" if sys.platform == "win32" else "lib"
_SO_SUFFIX = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")

LLAMA_WINDOW_PLACEMENT_SKIP = 0
LLAMA_WINDOW_PLACEMENT_CPU = 1
LLAMA_WINDOW_PLACEMENT_GPU = 2
LLAMA_WINDOW_PLACEMENT_CPU_REPACKED = 3  # patches/0008: run on the CPU from weights stored repacked in the file


def _bind(name: str, argtypes: list[object], restype: object) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    try:
        fn = getattr(_lib, name)
    except AttributeError:
        raise EngineError(
            f"the installed llama-cpp-python ({llama_cpp.__version__}) is not primaplug's patched build: "
            f"libllama has no {name}. Run `make setup` (or scripts/build_engine.py) to build and install it"
        ) from None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


# LLAMA_API const char * llama_window_supported_archs(void);
llama_window_supported_archs = _bind("llama_window_supported_archs", [], ctypes.c_char_p)

# LLAMA_API bool llama_model_supports_windows(const struct llama_model * model);
llama_model_supports_windows = _bind("llama_model_supports_windows", [_ll.llama_model_p_ctypes], ctypes.c_bool)

# LLAMA_API struct llama_model * llama_model_load_for_windows(
#                          const char * path_model,
#           struct llama_model_params   params,
#                       const uint8_t * placement,
#                              size_t   n_placement);
llama_model_load_for_windows = _bind(
    "llama_model_load_for_windows",
    [ctypes.c_char_p, _ll.llama_model_params, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t],
    _ll.llama_model_p_ctypes,
)

# typedef void (*llama_repacked_tensor_callback)(const char * name, const void * data, size_t size, void * user_data);
llama_repacked_tensor_callback = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                                  ctypes.c_void_p)
# LLAMA_API int32_t llama_model_repacked_tensors(const struct llama_model * model,
#                                                llama_repacked_tensor_callback callback, void * user_data);
llama_model_repacked_tensors = _bind(
    "llama_model_repacked_tensors",
    [_ll.llama_model_p_ctypes, llama_repacked_tensor_callback, ctypes.c_void_p],
    ctypes.c_int32,
)
# LLAMA_API void llama_set_repack_only(const char * const * names, size_t n_names);  (patches/0024)
llama_set_repack_only = _bind("llama_set_repack_only", [ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t], None)
# LLAMA_API void llama_set_vocab_size_only(bool size_only);  (patches/0025)
llama_set_vocab_size_only = _bind("llama_set_vocab_size_only", [ctypes.c_bool], None)
# LLAMA_API struct llama_context * llama_init_window_from_model(
#                  struct llama_model * model,
#         struct llama_context_params   params,
#                             int32_t   il_start,
#                             int32_t   il_end,
#                                bool   output_hidden);
llama_init_window_from_model = _bind(
    "llama_init_window_from_model",
    [_ll.llama_model_p_ctypes, _ll.llama_context_params, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool],
    _ll.llama_context_p_ctypes,
)

# LLAMA_API struct llama_context * llama_init_windows_from_model(
#                  struct llama_model * model,
#         struct llama_context_params   params,
#                       const int32_t * bounds,
#                              size_t   n_windows);
llama_init_windows_from_model = _bind(
    "llama_init_windows_from_model",
    [_ll.llama_model_p_ctypes, _ll.llama_context_params, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t],
    _ll.llama_context_p_ctypes,
)

# LLAMA_API int32_t llama_window_select(struct llama_context * ctx, int32_t i_window);
llama_window_select = _bind("llama_window_select", [_ll.llama_context_p_ctypes, ctypes.c_int32], ctypes.c_int32)

# LLAMA_API int32_t llama_window_set_logits(struct llama_context * ctx, const float * logits, int32_t n_rows);
# patches/0010: the context holds n_rows x n_vocab logits as if it had just decoded a batch with n_rows outputs
llama_window_set_logits = _bind(
    "llama_window_set_logits",
    [_ll.llama_context_p_ctypes, ctypes.POINTER(ctypes.c_float), ctypes.c_int32],
    ctypes.c_int32,
)

# LLAMA_API int32_t llama_window_row_width(const struct llama_model * model, int32_t il);
llama_window_row_width = _bind("llama_window_row_width", [_ll.llama_model_p_ctypes, ctypes.c_int32], ctypes.c_int32)
# LLAMA_API int32_t llama_window_set_row_end(struct llama_context * ctx, int32_t row_end);
llama_window_set_row_end = _bind("llama_window_set_row_end", [_ll.llama_context_p_ctypes, ctypes.c_int32],
                                 ctypes.c_int32)

# LLAMA_API size_t llama_window_release_compute(struct llama_context * ctx);
llama_window_release_compute = _bind("llama_window_release_compute", [_ll.llama_context_p_ctypes], ctypes.c_size_t)


# ggml's CPU thread pool (ggml.h, ggml-cpu.h). Without one, llama.cpp starts and joins fresh threads for every
# decode call; a window chain makes several calls per token, so a process keeps one pool for all its windows.
class ggml_threadpool_params(ctypes.Structure):  # noqa: N801
    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),  # GGML_MAX_N_THREADS
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


def _sibling(stem: str) -> ctypes.CDLL:
    """The copy of a ggml library that libllama itself loaded.

    Today's engines hold each library under one name (build.py: CMAKE_PLATFORM_NO_VERSIONED_SONAME). Those built
    before had it under several, as wheels cannot hold symlinks (libggml-cpu.so and libggml-cpu.so.0): opening
    another name than libllama's would load a second copy, whose uninitialised tables give NaNs when its threads
    compute. So take the file already mapped, else the versioned name that libllama links against.
    """
    folder = os.path.dirname(_lib._name)
    names = sorted(n for n in os.listdir(folder) if n.startswith(f"{_SO_PREFIX}{stem}.") and _SO_SUFFIX in n)
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.rsplit(None, 1)[-1] for line in maps if folder in line}
        names.sort(key=lambda n: os.path.join(folder, n) not in mapped)
    except OSError:  # not Linux: prefer the versioned name (libggml-cpu.so.0, libggml-cpu.0.dylib)
        names.sort(key=lambda n: n == f"{_SO_PREFIX}{stem}{_SO_SUFFIX}")
    if not names:
        raise EngineError(f"no {_SO_PREFIX}{stem}{_SO_SUFFIX} beside {_lib._name}")
    return ctypes.CDLL(os.path.join(folder, names[0]))


_ggml_base = _sibling("ggml-base")
_ggml_cpu = _sibling("ggml-cpu")


def load_for_windows(path: str, placement: ctypes.Array[ctypes.c_uint8], *, repack: bool, purpose: str,
                     repack_only: Collection[str] | None = None, vocab: bool = True) -> int:
    """llama_model_load_for_windows on the file mapping (repack: llama.cpp's use_extra_bufts; repack_only: of the
    weights it would repack, only these, the others left mapped; vocab: load the vocabulary's tokens, or its size
    only, for windows that never tokenize); raises EngineError with llama.cpp's own reason. `purpose` completes
    "could not load PATH ..."."""
    from primaplug.engine import _log

    _log.install()
    _ll.llama_backend_init()
    params = _ll.llama_model_default_params()
    params.use_extra_bufts = repack
    params.load_mode = _ll.LLAMA_LOAD_MODE_MMAP
    names = None if repack_only is None else (ctypes.c_char_p * max(len(repack_only), 1))(
        *(n.encode() for n in repack_only))
    llama_set_repack_only(names, len(repack_only or ()))  # None: repack all, as a load does by default
    llama_set_vocab_size_only(not vocab)
    try:
        ptr = llama_model_load_for_windows(path.encode(), params, placement, len(placement))
    finally:
        llama_set_repack_only(None, 0)
        llama_set_vocab_size_only(False)
    if not ptr:
        raise EngineError(f"could not load {path} {purpose}: {_log.take_errors() or 'see the log'}")
    return ptr


def ggml_cpu_path() -> str:
    """The CPU backend library in use: its code decides how weights are repacked (engine/repacked.py)."""
    return _ggml_cpu._name

# GGML_BACKEND_API int ggml_cpu_repack_bytes(enum ggml_type type, int64_t ne0, int64_t ne1, const void * src,
#                                           void * dst, size_t size);  (patches/0021)
ggml_cpu_repack_bytes = _ggml_cpu.ggml_cpu_repack_bytes
ggml_cpu_repack_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_size_t]
ggml_cpu_repack_bytes.restype = ctypes.c_int

# GGML_API struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);
ggml_threadpool_params_default = _ggml_base.ggml_threadpool_params_default
ggml_threadpool_params_default.argtypes = [ctypes.c_int]
ggml_threadpool_params_default.restype = ggml_threadpool_params

# GGML_BACKEND_API struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
ggml_threadpool_new = _ggml_cpu.ggml_threadpool_new
ggml_threadpool_new.argtypes = [ctypes.POINTER(ggml_threadpool_params)]
ggml_threadpool_new.restype = ctypes.c_void_p

# GGML_BACKEND_API void ggml_threadpool_free(struct ggml_threadpool * threadpool);
ggml_threadpool_free = _ggml_cpu.ggml_threadpool_free
ggml_threadpool_free.argtypes = [ctypes.c_void_p]
ggml_threadpool_free.restype = None

# GGML_BACKEND_API void ggml_threadpool_pause(struct ggml_threadpool * threadpool);
ggml_threadpool_pause = _ggml_cpu.ggml_threadpool_pause
ggml_threadpool_pause.argtypes = [ctypes.c_void_p]
ggml_threadpool_pause.restype = None

# GGML_BACKEND_API void ggml_threadpool_resume(struct ggml_threadpool * threadpool);
ggml_threadpool_resume = _ggml_cpu.ggml_threadpool_resume
ggml_threadpool_resume.argtypes = [ctypes.c_void_p]
ggml_threadpool_resume.restype = None

# LLAMA_API void llama_attach_threadpool(struct llama_context * ctx, ggml_threadpool_t threadpool,
#                                        ggml_threadpool_t threadpool_batch);
llama_attach_threadpool = _bind("llama_attach_threadpool", [_ll.llama_context_p_ctypes, ctypes.c_void_p,
                                                            ctypes.c_void_p], None)


def cpu_kernels() -> str:
    """Which kernels this engine's CPU backend runs: the machine, and the features llama.cpp was built with and sees
    (llama_print_system_info's CPU part: "x86_64 SSE3 ... AVX2 FMA ... REPACK"). Devices of one string round every
    operation alike; a ring of devices of several cannot give plain llama-cpp-python's logits on any one of them bit
    for bit (docs/platforms.md, "Rings that mix CPUs")."""
    features, in_cpu = [], False
    for part in (_ll.llama_print_system_info() or b"").decode(errors="replace").split("|"):
        if " : " in part:
            backend, part = part.split(" : ", 1)
            in_cpu = backend.strip() == "CPU"
        name, _, value = part.partition("=")
        if in_cpu and value.strip() not in ("", "0"):
            features.append(name.strip() if value.strip() == "1" else f"{name.strip()}={value.strip()}")
    return " ".join([platform.machine(), *features])


def supported_archs() -> tuple[str, ...]:
    """The architectures the native engine can run in windows."""
    raw = llama_window_supported_archs() or b""
    return tuple(a.strip() for a in raw.decode().split(",") if a.strip())
