"""crabd beyond one host: checkpoints as OCI artifacts in a registry.

`crabd checkpoint push CHECKPOINT REF` sends a checkpoint (its file-system
layer chain, its CRIU image's chunks, and a config describing it) to any OCI
registry; `crabd sandbox create --from REF` on another daemon pulls it and
starts a sandbox with the same files and, through CRIU, the same processes.

* `oci.py`       a small distribution-spec client on httpx (auth, digests)
* `layers.py`    a deltafs diff as a tar+zstd layer, and applying one safely
* `transfer.py`  push and pull against the daemon's stores (incremental)
* `testing.py`   a real registry (Debian's docker-registry) on 127.0.0.1
"""

from __future__ import annotations

__all__ = ["MANIFEST_TYPE", "ARTIFACT_TYPE", "CONFIG_TYPE", "FS_LAYER_TYPE", "PROC_PACK_TYPE"]

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.crabd.checkpoint.v1"
CONFIG_TYPE = "application/vnd.crabd.checkpoint.config.v1+json"
FS_LAYER_TYPE = "application/vnd.crabd.fs.layer.v1.tar+zstd"
PROC_PACK_TYPE = "application/vnd.crabd.criu.chunks.v1"  # concatenated zstandard frames; index in the config
