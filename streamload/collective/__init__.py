"""Collectives on the loader's own gloo group: summaries, plans and sample exchange."""
