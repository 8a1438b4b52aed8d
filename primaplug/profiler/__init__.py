"""The profilers: what a model costs per token (from its GGUF header) and what a device can do (measured on it,
cached), as the inputs of Halda's latency model (primaplug.core.profiles). See docs/profiler.md.

    from primaplug.engine import read_layout
    from primaplug.profiler import profile_device, profile_model, model_types
    model = profile_model(read_layout(path), n_ctx=4096, n_batch=512, n_ubatch=512)
    device = profile_device("laptop", model_types=model_types(model), layer_bytes=model.layer_bytes)

Importing this package loads no native code; measuring compute speed loads the engine.
"""

from primaplug.profiler.device import profile_device
from primaplug.profiler.model import (
    compute_buffer_layers_bytes,
    compute_buffer_output_bytes,
    layer_flops,
    model_types,
    normalise_type,
    output_flops,
    profile_model,
)

__all__ = [
    "compute_buffer_layers_bytes",
    "compute_buffer_output_bytes",
    "layer_flops",
    "model_types",
    "normalise_type",
    "output_flops",
    "profile_device",
    "profile_model",
]
