"""Images with text: the resizing rule, header probes, decoding, and the batches a VLM trains on.

`options.Images` makes a source multimodal; `rule` places an image on the encoder from its
size alone (planning needs no pixels); `probe` reads that size from the header; `decode` turns
bytes into the resized image's patches; `exchange` moves a step's encoded images with their
samples; `batch` builds the multimodal micro-batch.
"""
from .options import Images, llava, qwen2_vl

__all__ = ["Images", "llava", "qwen2_vl"]
