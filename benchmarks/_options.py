"""`--sl-opt KEY=VALUE`: extra streamload Loader options on a benchmark's command line."""
from __future__ import annotations

import argparse
import json


def add_loader_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sl-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="extra streamload Loader option (JSON value), repeatable")


def loader_options(items: list[str], **defaults) -> dict:
    """`defaults` updated with each KEY=VALUE; a VALUE that is not JSON stays a string."""
    options = dict(defaults)
    for item in items:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options
