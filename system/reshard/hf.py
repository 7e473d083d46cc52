"""What a Hugging Face checkpoint directory holds, read from its safetensors headers alone (no
torch, no tensor data): the master checks the weight-sync specs against it before anything
starts."""
from __future__ import annotations

import glob
import json
import os
import struct

from system.errors import ConfigError


def weight_names(directory: str) -> list[str]:
    """Every tensor name in ``directory/*.safetensors`` (each file's JSON header)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"no *.safetensors checkpoint in {directory}")
    names: list[str] = []
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        names += [k for k in header if k != "__metadata__"]
    return names
