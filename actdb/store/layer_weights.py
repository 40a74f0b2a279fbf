"""Where a model's per-layer weights live in the Zarr group, and the manifest saying what
is there (docs/FORMAT.md, "Layer weights").

    models/{model_id}/weights/                 group; its attributes hold the manifest
    models/{model_id}/weights/{layer}/attn/W_Q   float32 [heads * d_head, d]   (and W_O)
    models/{model_id}/weights/{layer}/attn/W_K   float32 [kv_heads * d_head, d] (and W_V)
    models/{model_id}/weights/{layer}/attn/b_Q, b_K, b_V [.., d_head], b_O [d]
    models/{model_id}/weights/{layer}/mlp/W_in, W_gate, W_out   float32 [neurons, d]
    models/{model_id}/weights/{layer}/mlp/b_in, b_gate [neurons], b_out [d]
    models/{model_id}/weights/{layer}/circuits/{OV,QK}/sigma  float32 [heads, d_head]
    models/{model_id}/weights/{layer}/circuits/{OV,QK}/u, v   float32 [heads * d_head, d]

Every row is a direction in the residual stream, so a head's or neuron's vector is a row.
Each array is chunked along its rows with a CRC-32C a chunk, as the other weights are.
"""

from __future__ import annotations

from typing import Any, Protocol


class Groups(Protocol):
    """What reading a manifest needs of the tensors (arrays.Arrays)."""

    def open_group(self, label: str) -> Any: ...

GROUP = "weights"
MANIFEST = "actdb_layer_weights"  # the group attribute holding the manifest


def array_name(layer: int, part: str, name: str) -> str:
    """The array's name under `models/{model_id}/`: part is `attn`, `mlp` (or `mlp.{expert}`),
    or `circuits/OV`, `circuits/QK`."""
    return f"{GROUP}/{layer}/{part}/{name}"


def read_manifest(arrays: Groups, model_id: int) -> dict[str, Any] | None:
    """The manifest of a model's layer weights; None for a model stored without them (with
    `--weights none`, or by a version before weights were stored)."""
    group = arrays.open_group(f"models/{model_id}/{GROUP}")
    if group is None:
        return None
    manifest = group.attrs.get(MANIFEST)
    return dict(manifest) if isinstance(manifest, dict) else None


def manifest_arrays(manifest: dict[str, Any]) -> list[str]:
    """The names of every array a manifest says is stored (verify checks each)."""
    names = []
    for entry in manifest.get("layers", []):
        layer = int(entry["layer"])
        attn = entry.get("attn")
        if attn:
            names += [array_name(layer, "attn", n) for n in attn["arrays"]]
            names += [array_name(layer, f"circuits/{c}", n) for c in ("OV", "QK")
                      for n in ("sigma", "u", "v")]
        for mlp in entry.get("mlp", []):
            part = "mlp" if mlp.get("expert") is None else f"mlp.{mlp['expert']}"
            names += [array_name(layer, part, n) for n in mlp["arrays"]]
    return names
