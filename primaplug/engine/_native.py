"""ctypes bindings of the layer-window API that patches/0001 and 0002 add to libllama.

Each binding sits under its C prototype from the patched llama.h, as in llama-cpp-python's own llama_cpp.py.
The patch adds functions only (no struct changes), so llama-cpp-python's struct mirrors stay valid.
"""

from __future__ import annotations

import ctypes

import llama_cpp
from llama_cpp import llama_cpp as _ll

from primaplug.core.errors import EngineError

_lib = _ll._lib  # the libllama that llama-cpp-python loaded (honours LLAMA_CPP_LIB_PATH)

LLAMA_WINDOW_PLACEMENT_SKIP = 0
LLAMA_WINDOW_PLACEMENT_CPU = 1
LLAMA_WINDOW_PLACEMENT_GPU = 2


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


def supported_archs() -> tuple[str, ...]:
    """The architectures the native engine can run in windows."""
    raw = llama_window_supported_archs() or b""
    return tuple(a.strip() for a in raw.decode().split(",") if a.strip())
