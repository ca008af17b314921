"""The asyncio side of the loader: per-source fetchers feeding ordered bounded buffers."""
