"""A Megatron-Energon-prepared dataset, read in place without Energon.

`energon prepare` leaves the WebDataset tars as they are and writes beside them a `.tar.idx`
per tar (sample offsets) and a `.nv-meta/` folder: `split.yaml` (which tars each split holds,
as brace patterns, and keys to exclude), `dataset.yaml` (the sample type and its `field_map`,
e.g. image: jpg, caption: txt), `.info.json` and an `index.sqlite`. The tars are plain
WebDataset, which streamload reads sequentially (`formats/webdataset.py`) and needs no index
for; the catalog leaves the `.idx` files and the hidden folder out.

`energon_source(root, split="train", images=...)` reads the two YAML files and returns the
`Source` that reads the split: its tars (the split's patterns expanded must be every tar under
`root`, since a source is a directory or a glob: a split that holds some of them is refused
with the names), with `text_field` and the image extension from `field_map` (a
`CaptioningWebdataset`'s caption and image; other sample types keep the defaults). A split
that excludes samples is refused too (streamload has no per-key exclusion).
"""
from __future__ import annotations

import os
import re

from ..config import Source
from ..errors import ConfigError

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand(pattern: str) -> list[str]:
    """`part-{000..002}.tar` -> part-000.tar, part-001.tar, part-002.tar (zero-padded as
    written; several ranges multiply), as Energon's braceexpand reads them."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    first, last = match.group(1), match.group(2)
    width = len(first) if first.startswith("0") else 0
    out = []
    for n in range(int(first), int(last) + 1):
        out += expand(pattern[:match.start()] + str(n).zfill(width) + pattern[match.end():])
    return out


def energon_source(root: str, split: str = "train", *, images=None, name=None,
                   **source_options) -> Source:
    import yaml
    meta = os.path.join(root, ".nv-meta")
    where = f"Energon dataset {root}: "
    try:
        with open(os.path.join(meta, "split.yaml")) as f:
            splits = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{where}no .nv-meta/split.yaml ({exc}); run `energon prepare` "
                          f"first, or read the tars as a WebDataset source") from None
    parts = (splits.get("split_parts") or {}).get(split)
    if parts is None:
        raise ConfigError(f"{where}no split {split!r}; it has "
                          f"{sorted(splits.get('split_parts') or {})}")
    if splits.get("exclude"):
        raise ConfigError(f"{where}split.yaml excludes {len(splits['exclude'])} sample(s); "
                          f"streamload cannot leave out single samples")
    wanted = sorted(name for p in parts for name in expand(p))
    present = sorted(f for f in os.listdir(root) if f.endswith(".tar"))
    if wanted != present:
        raise ConfigError(f"{where}split {split!r} holds {len(wanted)} of its {len(present)} "
                          f"tars ({', '.join(sorted(set(present) - set(wanted))[:3])} are "
                          f"not in it); a source reads a directory or a glob: move the "
                          f"other splits' tars to a folder of their own")
    text_field, image_fields = "txt", None
    try:
        with open(os.path.join(meta, "dataset.yaml")) as f:
            dataset = yaml.safe_load(f) or {}
    except OSError:
        dataset = {}
    fields = dataset.get("field_map") or {}
    if "caption" in fields:
        text_field = fields["caption"]
    if "image" in fields and images is not None:
        import msgspec
        image_fields = (fields["image"],)
        images = msgspec.structs.replace(images, fields=image_fields)
    return Source(root.rstrip("/") + "/", name=name, format="webdataset",
                  text_field=text_field, images=images, **source_options)
