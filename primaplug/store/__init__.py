"""Model files a device holds only in part: a node without the model's file fetches exactly the pieces its windows
run (the header, its layers' tensors) from a holder into a sparse copy in its model folder, checks each against the
manifest the head computed from its own file, and maps the copy as it would the whole file (docs/distribute.md).

- `manifest.py`: a file cut into pieces (the header, then each run of one layer's tensors, at most PIECE_BYTES),
  their hashes, and which pieces a set of layers needs;
- `copy.py`: the sparse copies in a node's model folder, what each holds, within a disk budget;
- `fetch.py`: fetching pieces from holders (pipelined, verified, resumable), dropping holders that fail or lie;
- `holder.py`: answering GetManifest and ReadPiece, for a head's file (HolderService) or a node's copies;
- `hub.py`: where the head's own copy comes from: a path, a Hugging Face reference, a model in several files.
"""

from primaplug.store.copy import SparseCopy, Store
from primaplug.store.fetch import Fetcher, FetchError, FetchProgress
from primaplug.store.holder import HolderService, answer
from primaplug.store.hub import resolve_model
from primaplug.store.manifest import PIECE_BYTES, file_manifest, header_pieces, needed_pieces, piece_plan

__all__ = ["PIECE_BYTES", "FetchError", "FetchProgress", "Fetcher", "HolderService", "SparseCopy", "Store", "answer",
           "file_manifest", "header_pieces", "needed_pieces", "piece_plan", "resolve_model"]
